"""Remedies for the drift of re-encoded recurrent states: `rounding: stochastic`, `error_feedback` (+ `error_codec`).

Oracles written here: the grid step of each format from its definition (math.frexp, the format's mantissa bits),
Hoeffding's bound for the mean of stochastic roundings, a naive error-feedback loop over the codec's encode/decode,
a float64 linear recurrence, and for rollback / restore / batch operations / save-load the same cache fed another way
(split blocks, fresh, reordered rows), compared bit for bit on every held part (residuals included).
"""

import math

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.recurrent.codecs import available_state_codecs, get_state_codec
from hybridcache.checkpoints.tiny import tiny_checkpoint

MAMBA2 = {"num_heads": 2, "head_dim": 3, "state_size": 8, "n_groups": 1, "conv_kernel": 4}
SHAPE = (2, 3, 8)  # mamba2 ssm [H, P, N]
FP8 = [c for c in ("float8_e4m3fn", "float8_e5m2") if c in available_state_codecs()]
MANTISSA = {"bfloat16": 7, "float16": 10, "float8_e4m3fn": 3, "float8_e5m2": 2}
MIN_NORMAL_EXP = {"bfloat16": -126, "float16": -14, "float8_e4m3fn": -6, "float8_e5m2": -14}
LOSSY = ["int8", "int4", *FP8, "bfloat16", "float16"]
REMEDIES = {"rounding": "stochastic", "error_feedback": True}


def cache_of(params, batch=2, rollback=0, dtype=torch.float32):
    config = {"recurrent": {"type": "mamba2", **params, **({"rollback": rollback} if rollback else {})}}
    return Cache.build([NativeLayer("mamba2", {**MAMBA2, "dtype": dtype})], batch, config)


def grid_step(codec, x64, group="channel"):
    """Float64 spacing of the codec's values around each element of x [B, *SHAPE], from the format's definition."""
    if codec in ("int8", "int4"):
        levels = {"int8": 127, "int4": 7}[codec]
        return x64.abs().amax(-1, keepdim=True).expand_as(x64) / levels  # channel: one scale per last-axis vector
    if codec in FP8:
        scale = x64.abs().amax(-1, keepdim=True) / torch.finfo(getattr(torch, codec)).max
        y = x64 / scale
    else:
        scale, y = torch.ones_like(x64), x64
    steps = [
        2.0 ** (max(math.frexp(abs(v))[1] - 1, MIN_NORMAL_EXP[codec]) - MANTISSA[codec]) for v in y.flatten().tolist()
    ]
    return torch.tensor(steps, dtype=torch.float64).reshape(x64.shape) * scale


def off_grid(seed=0):
    """x [2, *SHAPE]: values of mixed magnitudes, none on a grid point."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, *SHAPE, generator=g, dtype=torch.float64) * torch.tensor([0.05, 3.0], dtype=torch.float64).view(
        2, 1, 1, 1
    )
    return x.float()


@pytest.mark.parametrize("codec", LOSSY)
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(codec):
    """Each stochastic encoding decodes to one of the two grid points around x (so within one step); their mean over
    N draws converges to x. Hoeffding: each draw lies in an interval of width `step` around x, so
    P(|mean - x| >= t) <= 2 exp(-2 N t^2 / step^2); over K elements with total failure chance delta,
    t = step * sqrt(ln(2K / delta) / (2N)). Nearest rounding has the same mean for every N: its bias |round(x) - x|
    stays above that bound wherever x is at least a quarter step from a grid point."""
    c, x, n, delta = get_state_codec(codec), off_grid(), 3000, 1e-6
    x64, step = x.double(), grid_step(codec, x.double())
    g = torch.Generator().manual_seed(1)
    total = torch.zeros_like(x64)
    for _ in range(n):
        got = c.decode(c.encode(x, SHAPE, torch.rand(SHAPE, generator=g)), SHAPE, torch.float64)
        assert bool(((got - x64).abs() < step * (1 + 1e-6)).all())  # one of the two neighbours
        total += got
    bound = step * math.sqrt(math.log(2 * x.numel() / delta) / (2 * n))
    assert bool(((total / n - x64).abs() <= bound).all())
    nearest_bias = (c.decode(c.encode(x, SHAPE), SHAPE, torch.float64) - x64).abs()
    far = nearest_bias >= step / 4
    assert int(far.sum()) > x.numel() // 10  # the data has many such elements
    assert bool((nearest_bias[far] > bound[far]).all())


def test_stochastic_rounding_keeps_exact_values_and_the_format_range():
    c = get_state_codec("float16")
    x = torch.tensor([[0.0, 1.0, -2.5, 65504.0, 65503.0, 1e6]])
    for seed in range(20):
        u = torch.rand(x.shape[1:], generator=torch.Generator().manual_seed(seed))
        got = c.decode(c.encode(x, (6,), u), (6,), torch.float32)
        assert got[0, :4].tolist() == [0.0, 1.0, -2.5, 65504.0]  # grid points stay
        assert got[0, 4] in (65472.0, 65504.0) and got[0, 5] == float("inf")  # clamped at the top; past it as nearest


def feed(cache, states, tokens=1, trail=None):
    with cache.block(None, tokens):
        cache[0].update(trail=trail, **states)


def random_states(cache, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn((cache.batch_size, *lead, *shape), generator=g).to(dtype)
        for n, (shape, dtype) in cache[0].spec.state_shapes().items()
    }


def held(cache):
    layer = cache[0]
    return {a: getattr(layer, a).clone() for a in layer._parts}


def current(parts):
    """The held parts without checkpoint trails."""
    return {a: t for a, t in parts.items() if not a.endswith("_trail")}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_stochastic_rounding_is_seeded_per_cache_and_column():
    a, b = (
        cache_of({"state_codec": "int4", "rounding": "stochastic"}),
        cache_of({"state_codec": "int4", "rounding": "stochastic"}),
    )
    other = cache_of({"state_codec": "int4", "rounding": "stochastic", "rounding_seed": 7})
    nearest = cache_of({"state_codec": "int4"})
    for step in range(3):
        s = random_states(a, step)
        for c in (a, b, other, nearest):
            feed(c, s)
        assert_same(held(a), held(b))  # the same seed: the same draws
        assert not torch.equal(a[0].ssm_q, other[0].ssm_q) and not torch.equal(a[0].ssm_q, nearest[0].ssm_q)
    u3, u4 = (a[0].layout.noise("ssm", c, 0, torch.device("cpu")) for c in (3, 4))
    assert not torch.equal(u3, u4)  # each column draws its own uniforms
    assert torch.equal(u3, a[0].layout.noise("ssm", 3, 0, torch.device("cpu")))
    assert not torch.equal(u3, a[0].layout.noise("ssm", 3, 1, torch.device("cpu")))  # each layer its own


@pytest.mark.parametrize("error_codec", [None, "bfloat16", "int4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_feedback_equals_a_naive_loop(error_codec, rounding):
    """r = 0; each step: q = decode(encode(x + r)); r = x + r - q (held in error_codec: its round trip)."""
    params = {"state_codec": "int8", "error_feedback": True, "rounding": rounding, "quantize_conv": True}
    cache = cache_of({**params, **({"error_codec": error_codec} if error_codec else {})}, batch=2)
    codec, res = get_state_codec("int8"), get_state_codec(error_codec or "dense")
    shapes = cache[0].spec.state_shapes()
    r = {n: torch.zeros(2, *s) for n, (s, _) in shapes.items()}
    for step in range(6):
        x = random_states(cache, step)
        feed(cache, x)
        for n, (shape, dtype) in shapes.items():
            u = cache[0].layout.noise(n, step + 1, 0, torch.device("cpu")) if rounding == "stochastic" else None
            q = codec.decode(codec.encode(x[n] + r[n], shape, u), shape, dtype)
            r[n] = res.decode(res.encode(x[n] + r[n] - q, shape), shape, dtype)
            assert torch.equal(cache[0].states[n], q), (step, n)
            assert torch.equal(cache[0].layout.decode_residual(held(cache), n), r[n]), (step, n)


@pytest.mark.parametrize("codec", ["int8", "int4", "bfloat16"])
def test_error_feedback_keeps_a_slow_recurrence_on_track(codec):
    """s_t = a s_{t-1} + b_t (a = 0.999, |b_t| well below a code step): rounding to nearest freezes the held state
    (each increment rounds away), error feedback keeps it within two steps of the float64 truth (its residual
    carries what the codes cannot, and q_t + r_t follows the recurrence exactly)."""
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(1, *SHAPE, generator=g, dtype=torch.float64)
    drift = torch.randn(1, *SHAPE, generator=g, dtype=torch.float64) * 2e-4
    runs = {ef: cache_of({"state_codec": codec, "error_feedback": ef}, batch=1) for ef in (False, True)}
    conv = torch.zeros(1, *runs[False][0].spec.state_shapes()["conv"][0])
    for c in runs.values():
        feed(c, {"conv": conv, "ssm": truth.float()})
    for _ in range(1500):
        truth = 0.999 * truth + drift
        for c in runs.values():
            feed(c, {"conv": conv, "ssm": (0.999 * c[0].states["ssm"].double() + drift).float()})
    step = grid_step(codec, truth).amax()
    err = {ef: float((c[0].states["ssm"].double() - truth).abs().max()) for ef, c in runs.items()}
    assert err[True] <= 2 * float(step) < err[False]


def test_residual_bytes_are_counted():
    """codes + scales, plus the residual in its codec; conv (held dense) keeps none. Batch 3, state + a trail of 2."""
    h, p, n, conv = 2, 3, 8, (2 * 3 + 2 * 8) * 3
    codes = h * p * n * 1 + h * p * 4  # int8 + a float32 scale per (head, head_dim)
    residual = {None: h * p * n * 4, "bfloat16": h * p * n * 2, "int4": (h * p * n + 1) // 2 + h * p * 4}
    for rc, extra in residual.items():
        cache = cache_of({"state_codec": "int8", "error_feedback": True, **({"error_codec": rc} if rc else {})}, 3, 2)
        want = 3 * 3 * (codes + extra + conv * 4)
        assert cache[0].nbytes() == cache[0].spec.min_nbytes(3, 1) == cache.plan.held_nbytes(3, 1) == want
        assert "ssm_residual" in "".join(cache[0].layout.attrs) and "conv_residual" not in "".join(
            cache[0].layout.attrs
        )


@pytest.mark.parametrize("params", [REMEDIES, {**REMEDIES, "error_codec": "int4", "state_codec": "int4"}])
def test_crop_to_a_checkpoint_equals_the_split_feed(params):
    """A 4-token block with rollback, cropped to column 2, then continued, equals a 2-token block then the same
    continuation: the trail's states were encoded as a block ending there would have been (same residual fed back,
    the uniforms of that column)."""
    params = {"state_codec": "int8", **params}
    whole, split = cache_of(params, rollback=3), cache_of(params, rollback=3)
    feed(whole, random_states(whole, 0)), feed(split, random_states(split, 0))  # a residual to feed back
    steps = random_states(whole, 1, lead=(4,))  # the states after columns 2..5
    feed(whole, {n: t[:, 3] for n, t in steps.items()}, 4, trail={n: t[:, :3] for n, t in steps.items()})
    whole.crop(3)
    feed(split, {n: t[:, 1] for n, t in steps.items()}, 2, trail={n: t[:, :1] for n, t in steps.items()})
    assert_same(current(held(whole)), current(held(split)))
    for step in range(2, 5):
        s = random_states(whole, step)
        feed(whole, s), feed(split, s)
        assert_same(current(held(whole)), current(held(split)))  # (their older trail entries differ: not compared)


def test_snapshot_restore_reset_and_batch_operations_carry_the_residual():
    params = {"state_codec": "int8", **REMEDIES, "error_codec": "bfloat16"}
    cache = cache_of(params, batch=3, rollback=2)
    for step in range(3):
        feed(cache, random_states(cache, step))
    snap = cache.snapshot()
    after = []
    for step in range(3, 6):
        feed(cache, random_states(cache, step))
        after.append(held(cache))
    cache.restore(snap)
    for step, want in zip(range(3, 6), after):
        feed(cache, random_states(cache, step))
        assert_same(held(cache), want)
    # reorder: moving rows first and feeding moved states equals feeding then moving (the uniforms are per element,
    # shared by the rows; residuals move with their rows)
    perm = torch.tensor([2, 0, 1])
    moved = cache_of(params, batch=3, rollback=2)
    moved.restore(snap)
    moved.reorder(perm)
    cache.restore(snap)
    s = random_states(cache, 9)
    feed(cache, s)
    feed(moved, {n: t[perm] for n, t in s.items()})
    assert_same({a: t[perm] for a, t in held(cache).items()}, held(moved))
    # select / repeat: a repeated row continues exactly as its original
    cache.restore(snap)
    cache.select([1])
    cache.repeat(2)
    feed(cache, {n: t[[1, 1]] for n, t in s.items()})
    assert_same({a: t[:1] for a, t in held(cache).items()}, {a: t[1:] for a, t in held(cache).items()})
    assert_same(
        {a: t[:1] for a, t in held(cache).items()}, {a: t[2:3] for a, t in held(moved).items()}
    )  # moved row 2 = row 1
    # reset: residuals back to zero, so it continues as a fresh cache
    cache.reset()
    fresh = cache_of(params, batch=2, rollback=2)
    assert_same(held(cache), held(fresh))
    feed(cache, {n: t[:2] for n, t in s.items()}), feed(fresh, {n: t[:2] for n, t in s.items()})
    assert_same(held(cache), held(fresh))


def test_offloaded_remedies_equal_the_resident_ones():
    params = {"state_codec": "int8", **REMEDIES}
    resident, parked = cache_of(params, rollback=2), cache_of({**params, "offload": True}, rollback=2)
    for step in range(4):
        feed(resident, random_states(resident, step)), feed(parked, random_states(parked, step))
    parked[0]._fetch()
    assert_same(held(resident), held(parked))
    parked[0]._park()
    assert resident[0].nbytes() == parked[0].nbytes()


def test_a_saved_cache_with_remedies_continues_as_the_original(tmp_path):
    model = hc.from_pretrained(tiny_checkpoint("mamba2"))
    config = {"recurrent": {"state_codec": "int4", **REMEDIES, "error_codec": "bfloat16", "rollback": 2}}
    ids = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(2, config)
    model(ids[:, :6], cache)
    model(ids[:, 6:7], cache)
    assert any("residual" in n for s in cache.snapshot().layers for n in s.tensors)
    cache.save(tmp_path / "c.safetensors", model)
    loaded = hc.Cache.load(tmp_path / "c.safetensors", model, cache_config=config)
    for t in range(7, 11):
        assert torch.equal(model(ids[:, t : t + 1], cache), model(ids[:, t : t + 1], loaded))
    for a, b in zip(cache.snapshot().layers, loaded.snapshot().layers):
        assert_same(dict(a.tensors), dict(b.tensors))


@pytest.mark.parametrize(
    "params,message",
    [
        ({"state_codec": "int8", "rounding": "up"}, "rounding must be one of nearest, stochastic, got 'up'"),
        ({"state_codec": "int8", "rounding": "stochastic", "rounding_seed": -1}, "rounding_seed must be an integer"),
        ({"state_codec": "int8", "rounding": "stochastic", "rounding_seed": True}, "rounding_seed must be an integer"),
        ({"state_codec": "int8", "rounding_seed": "3"}, "rounding_seed must be an integer"),
        ({"state_codec": "int8", "rounding_seed": 2**63}, "rounding_seed must be an integer"),
        ({"state_codec": "int8", "error_feedback": "yes"}, "error_feedback must be true or false"),
        ({"state_codec": "int8", "error_feedback": True, "error_codec": "int3"}, "unknown state_codec 'int3'"),
        ({"state_codec": "int8", "error_feedback": True, "error_codec": "zero"}, "error_codec zero drops"),
        ({"state_codec": "int8", "error_codec": "bfloat16"}, "error_codec only applies with error_feedback"),
        ({"rounding": "stochastic"}, "rounding: stochastic needs a state_codec that rounds"),
        ({"state_codec": "zero", "error_feedback": True}, "error_feedback needs a lossy state_codec"),
        ({"state_codec": "dense", "error_feedback": True}, "error_feedback needs a lossy state_codec"),
    ],
)
def test_bad_remedy_values_fail_clearly_before_anything_is_built(params, message):
    with pytest.raises(CacheConfigError, match=message):
        hc.cache.resolve_plan([NativeLayer("mamba2", MAMBA2)], {"recurrent": params})


def test_the_old_name_residual_codec_is_refused_naming_error_codec():
    """`residual_codec` was renamed to `error_codec` (2026-11-29): a config still giving it is told the new name."""
    with pytest.raises(CacheConfigError, match=r"recurrent\.residual_codec was renamed to 'error_codec'"):
        cache_of({"state_codec": "int8", "error_feedback": True, "residual_codec": "int4"})

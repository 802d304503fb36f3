"""Recurrent state codecs (`state_codec`), offload of recurrent states, and the per-layer sensitivity helper.

Error bounds are checked against an independent float64 computation of each format written here; the contract
checks (staging, batch operations, rollback, snapshot, accounting) are the conformance kit's
(tests/cache/test_conformance.py runs it over every codec)."""

import math

import pytest
import torch

import hybridcache as hc
from experiments.study.state_sensitivity import layer_sensitivity, stepwise_logits
from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.recurrent.codecs import available_state_codecs, get_state_codec
from hybridcache.checkpoints.tiny import tiny_checkpoint

SHAPES = {"mamba2 ssm": (4, 3, 8), "mamba ssm": (6, 5), "rglru lru": (7,), "conv": (5, 3)}
FP8 = [c for c in ("float8_e4m3fn", "float8_e5m2") if c in available_state_codecs()]
MAMBA2 = {"num_heads": 4, "head_dim": 3, "state_size": 8, "n_groups": 1, "conv_kernel": 4}


def reference_scales(x, shape, group, top):
    """absmax / top per group, float64: channel = per vector along the last axis, head = per first-axis index."""
    lead = x.dim() - len(shape)
    keep = len(shape) - 1 if group == "channel" else min(1, len(shape) - 1)
    flat = x.double().reshape(*x.shape[: lead + keep], -1)  # [.., groups.., elements]
    return flat.abs().amax(-1) / top, keep


def expand(scale, keep, shape):
    return scale.reshape(*scale.shape, *([1] * (len(shape) - keep)))


def data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, *shape, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, 3, dtype=torch.float64)[
        :, None
    ].reshape(3, *([1] * len(shape)))
    x[0].view(-1)[0] = 0.0
    return x.float()


@pytest.mark.parametrize("codec,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("group", ["channel", "head"])
@pytest.mark.parametrize("what", list(SHAPES))
def test_integer_codecs_are_within_half_a_step(codec, levels, group, what):
    shape = SHAPES[what]
    x = data(shape)
    c = get_state_codec(codec, group)
    parts = c.encode(x, shape)
    scale, keep = reference_scales(x, shape, group, levels)
    assert torch.allclose(parts["scale"].double(), scale.clamp(min=torch.finfo(torch.float32).tiny), rtol=1e-6)
    got = c.decode(parts, shape, torch.float32).double()
    err = (got - x.double()).abs()
    assert bool((err <= expand(scale, keep, shape) / 2 * (1 + 1e-4) + 1e-12).all())
    q = torch.round(x.double() / expand(scale, keep, shape).clamp(min=1e-300)).clamp(-levels, levels)
    assert (got - q * expand(scale, keep, shape)).abs().max() < 1e-5 * float(x.abs().max())  # the same integers
    if codec == "int4":  # packed: two values per byte, a pad nibble for an odd count
        assert parts["q"].dtype == torch.uint8 and parts["q"].shape[-1] == (math.prod(shape) + 1) // 2


@pytest.mark.parametrize("codec", FP8)
@pytest.mark.parametrize("group", ["channel", "head"])
def test_fp8_codecs_are_within_half_an_fp8_step(codec, group):
    shape = SHAPES["mamba2 ssm"]
    x = data(shape, seed=1)
    fp8 = getattr(torch, codec)
    info = torch.finfo(fp8)
    mantissa = {"float8_e4m3fn": 3, "float8_e5m2": 2}[codec]
    c = get_state_codec(codec, group)
    parts = c.encode(x, shape)
    assert parts["q"].dtype == fp8
    scale, keep = reference_scales(x, shape, group, info.max)
    s = expand(scale, keep, shape)
    got = c.decode(parts, shape, torch.float32).double()
    # relative half step 2^-(m+1) for normal values, half the subnormal step below
    bound = torch.maximum(x.double().abs() * 2.0 ** -(mantissa + 1), s * info.smallest_normal * 2.0 ** -(mantissa + 1))
    assert bool(((got - x.double()).abs() <= bound * (1 + 1e-4) + 1e-12).all())
    assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize(
    "codec,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_float_codecs_are_casts(codec, dtype):
    shape = SHAPES["mamba ssm"]
    x = data(shape).double()
    c = get_state_codec(codec)
    assert torch.equal(c.decode(c.encode(x, shape), shape, torch.float64), x.to(dtype).double())
    assert c.exact_for(dtype) and c.exact_for(torch.float32) == (codec == "float32")


def layer(params, batch=2, rollback=0, dtype=torch.float32):
    config = {"recurrent": {"type": "mamba2", **params, **({"rollback": rollback} if rollback else {})}}
    return Cache.build([NativeLayer("mamba2", {**MAMBA2, "dtype": dtype})], batch, config)


@pytest.mark.parametrize("codec", ["dense", "float32", "bfloat16", *FP8, "int8", "int4"])
@pytest.mark.parametrize("quantize_conv", [False, True])
def test_bytes_held_are_codes_plus_scales(codec, quantize_conv):
    cache = layer({"state_codec": codec, "quantize_conv": quantize_conv}, batch=3, rollback=2)
    h, p, n, conv = 4, 3, 8, (4 * 3 + 2 * 8) * 3  # ssm [H, P, N], conv [H*P + 2*G*N, K-1]
    code = {"dense": 4, "float32": 4, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
    scales = {"channel": h * p * 4}
    if codec == "int4":
        ssm = (h * p * n + 1) // 2 + scales["channel"]
        conv_b = (conv + 1) // 2 + (4 * 3 + 2 * 8) * 4 if quantize_conv else conv * 4
    else:
        scaled = codec in ("int8", *FP8)
        ssm = h * p * n * code[codec] + (scales["channel"] if scaled else 0)
        conv_b = (conv * code[codec] + ((4 * 3 + 2 * 8) * 4 if scaled else 0)) if quantize_conv else conv * 4
    want = 3 * 3 * (ssm + conv_b)  # batch 3, the state + a trail of 2
    assert cache[0].nbytes() == cache[0].spec.min_nbytes(3, 5) == cache.plan.held_nbytes(3, 5) == want
    records = cache.plan.to_records(batch=3)
    assert records[0]["bytes"] == want and records[0]["exact"] == (codec in ("dense", "float32"))


def test_state_dtype_is_what_the_mixer_sees_and_the_codec_what_is_held():
    cache = layer({"state_codec": "int8", "state_dtype": torch.float64}, batch=1)
    st = cache[0].states
    assert st["ssm"].dtype == torch.float64 and cache[0].ssm_q.dtype == torch.int8
    cache = layer({"state_dtype": torch.bfloat16}, batch=1)  # state_dtype alone: held as it is, as before
    assert cache[0].ssm.dtype == torch.bfloat16 and cache[0].is_exact
    assert not layer({"state_codec": "bfloat16"})[0].is_exact


def test_bad_codec_parameters_fail_clearly():
    with pytest.raises(CacheConfigError, match="unknown state_codec 'int3'.*int4.*int8"):
        layer({"state_codec": "int3"})
    with pytest.raises(CacheConfigError, match="state_group must be one of channel, head"):
        layer({"state_codec": "int8", "state_group": "token"})
    with pytest.raises(CacheConfigError, match="quantize_conv must be true or false"):
        layer({"quantize_conv": "yes"})


def feed(cache, seed):
    g = torch.Generator().manual_seed(seed)
    new = {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in cache[0].states.items()}
    with cache.block(None, 1):
        cache[0].update(**new)
    return new


@pytest.mark.parametrize("codec", ["dense", "int8"])
def test_offloaded_states_equal_the_resident_ones(codec):
    """On the CPU, offload parks the held parts in memory-mapped files: the states stay bit-exact."""
    resident, parked = (
        layer({"state_codec": codec}, rollback=2),
        layer({"state_codec": codec, "offload": True}, rollback=2),
    )
    assert parked[0]._tier is not None and resident[0]._tier is None
    for step in range(4):
        feed(resident, step), feed(parked, step)
        for name in ("conv", "ssm"):
            assert torch.equal(resident[0].states[name], parked[0].states[name])
    attrs = parked[0].layout.attrs
    assert all(getattr(parked[0], a) is parked[0]._tier.parked[a] for a in attrs)  # nothing fetched between blocks
    assert parked[0].nbytes() == resident[0].nbytes()
    for c in (resident, parked):
        c.crop(2)
        c.reorder([1, 0])
    assert all(torch.equal(resident[0].states[n], parked[0].states[n]) for n in ("conv", "ssm"))


def test_int8_states_save_and_load_as_they_are(tmp_path):
    model = hc.from_pretrained(tiny_checkpoint("mamba2"))
    config = {"recurrent": {"state_codec": "int8", "rollback": 2}}
    ids = torch.randint(0, model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(2, config)
    model(ids[:, :6], cache)
    model(ids[:, 6:7], cache)
    cache.save(tmp_path / "c.safetensors", model)
    loaded = hc.Cache.load(tmp_path / "c.safetensors", model, cache_config=config)
    for a, b in zip(cache.snapshot().layers, loaded.snapshot().layers):
        assert a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert any(t.dtype == torch.int8 for s in loaded.snapshot().layers for t in s.tensors.values())
    assert torch.equal(model(ids[:, 7:], cache), model(ids[:, 7:], loaded))


FAMILIES = ["jamba", "mamba2", "zamba2", "recurrentgemma", "qwen3_next", "lfm2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_hybrids_with_lossy_states_stay_close_on_short_prompts(family):
    model = hc.from_pretrained(tiny_checkpoint(family))
    ids = torch.randint(0, model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = stepwise_logits(model, ids, prompt_len=16)
    for codec, bound in (("bfloat16", 0.5), ("int8", 0.5)):
        config = {"recurrent": {"state_codec": codec, "quantize_conv": family == "lfm2"}}
        got = stepwise_logits(model, ids, 16, config)
        err = float((got - ref).abs().max())
        print(f"{family} {codec}: max |dlogit| over 8 decode steps {err:.2e}")
        assert bool(torch.isfinite(got).all()) and err < bound
        out = hc.generate(model, ids[:, :16], max_new_tokens=3, cache_config=config)
        assert bool(torch.isfinite(out.logits).all())
    exact = stepwise_logits(model, ids, 16, {"recurrent": {"state_codec": "float32"}})
    assert torch.equal(exact, ref)


def test_error_over_a_long_generation_is_measured(capsys):
    """256 decode steps, teacher-forced on the float32 greedy tokens: the error is printed, bounds are only sane."""
    model = hc.from_pretrained(tiny_checkpoint("mamba2"))
    ids = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    seq = hc.generate(model, ids, max_new_tokens=257, output_logits=False).sequences
    ref = stepwise_logits(model, seq, 16)
    for codec in ("bfloat16", "int8"):
        err = (stepwise_logits(model, seq, 16, {"recurrent": {"state_codec": codec}}) - ref).abs().amax(-1)[0]
        with capsys.disabled():
            print(
                f"\nmamba2 tiny, {codec} states: max |dlogit| after 32 steps {float(err[32]):.2e}, after 256 "
                f"{float(err[256]):.2e}, worst {float(err.max()):.2e} (logits up to {float(ref.abs().max()):.1f})"
            )
        assert bool(torch.isfinite(err).all()) and float(err.max()) < 5.0


def test_sensitivity_runs_and_float32_costs_nothing():
    model = hc.from_pretrained(tiny_checkpoint("jamba"))
    ids = torch.randint(0, model.vocab_size, (1, 14), generator=torch.Generator().manual_seed(3))
    rows = layer_sensitivity(model, ids, prompt_len=8, codecs=("float32", "int4"))
    recurrent = [p.address for p in model.make_cache(1).plan.layers if p.kind == "recurrent"]
    assert [r["layer"] for r in rows] == [a for a in recurrent for _ in range(2)]
    for r in rows:
        if r["codec"] == "float32":
            assert r["kl"] == 0 and r["nll_increase"] == 0 and r["max_abs_dlogit"] == 0
        else:
            assert r["kl"] >= 0 and math.isfinite(r["nll_increase"]) and r["max_abs_dlogit"] > 0


@pytest.mark.parametrize("family", ["mamba2", "mamba", "recurrentgemma", "qwen3_next", "lfm2"])
def test_the_zero_codec_drops_every_recurrent_state_after_each_block(family):
    """`state_codec: zero` (+ quantize_conv: configs/cache/ablate_state.yaml), the control of state studies: a
    sequence fed in blocks of 4 gives, for each block, the logits the model computes from a fresh cache for the
    recurrent layers (the independent oracle: that block's states start from zeros) while attention layers keep
    their keys; on an all-recurrent model, exactly a fresh model run on each block alone. It holds 0 bytes."""
    model = hc.from_pretrained(tiny_checkpoint(family))
    ids = torch.randint(3, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    ablate = {"recurrent": {"state_codec": "zero", "quantize_conv": True}}
    cache = model.make_cache(2, ablate)
    got = torch.cat([model(ids[:, i : i + 4], cache) for i in range(0, 12, 4)], dim=1)
    recurrent = [layer for layer in cache.layers if layer.kind == "recurrent"]
    assert recurrent and all(layer.nbytes() == 0 for layer in recurrent)
    if all(n.type != "full" and n.type != "sliding" for n in model.native_layers()):  # no attention: blocks alone
        alone = torch.cat([model(ids[:, i : i + 4]) for i in range(0, 12, 4)], dim=1)
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    first = model(ids[:, :4])
    torch.testing.assert_close(got[:, :4], first, atol=1e-5, rtol=1e-5)  # the first block has nothing to lose
    assert (got[:, 4:] - model(ids)[:, 4:]).abs().max() > 1e-3  # later blocks lose what their states carried

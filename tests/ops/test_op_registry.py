"""The registered ops (hybridcache/accel/native/op_registry.py, declared in op_declarations.py): for every op, on
randomized
shapes,
the eager op == the torch.compile'd op (fullgraph, no graph breaks) == the pure-torch reference (op_reference.py,
up to float32 rounding order), the fake implementation's outputs have the real outputs' shapes, dtypes and
strides, and arguments that break the declared rules raise KernelArgumentError before any C function is touched."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import hybridcache.accel as accel
import hybridcache.accel.native.library as cpu_library
from hybridcache.accel.native.op_declarations import DECLARATIONS
from hybridcache.accel.native.op_registry import KERNELS, REFERENCES, op
from hybridcache.ops import q8_0

NAMES = [decl.name for decl in DECLARATIONS]
W_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _weight(r: random.Random, g, n, k):
    dtype = r.choice(W_DTYPES)
    w = torch.randn(n, k, generator=g)
    if k % 32 == 0 and r.random() < 0.3:  # q8_0: int8 with a float16 scale per block of 32
        return q8_0.pack(w)
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 64
    return w.to(dtype), (torch.rand(n, generator=g) + 0.5 if r.random() < 0.3 else None)


def _cos_sin(r, g, b, t, d):
    rot = 2 * r.randint(0, d // 2)
    ang = torch.randn(b, 1, t, rot, generator=g)
    return ang.cos(), ang.sin()


def sample(name: str, seed: int) -> tuple:
    """Random arguments of op `name` that follow its declared rules (sizes small, some of them 1)."""
    r, g = random.Random(seed), torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    opt = lambda t: t if r.random() < 0.6 else None  # noqa: E731
    b, t, d = r.randint(1, 3), r.randint(1, 4), r.choice([1, 2, 8, 17, 32])
    if name == "decode_linear":
        w, scale = _weight(r, g, r.randint(1, 40), d)
        return n(b, r.randint(1, 3), d), w, opt(n(w.shape[0])), scale
    if name == "decode_linear_q8_0":
        k = 32 * r.randint(1, 4)
        w, scale = q8_0.pack(n(r.randint(1, 40), k) * r.choice([1e-3, 1.0, 30.0]))
        return n(b, r.randint(1, 20), k), w, opt(n(w.shape[0])), scale
    if name == "rms_norm":
        return n(b, t, d), n(d), r.choice([1e-6, 1e-5, 0.1])
    if name == "residual_norm":
        return n(b, t, d), n(b, t, d), opt(n(d)), 1e-6, opt(n(d)), 1e-5
    if name == "act_mul":
        return n(b, t, 2 * d), r.choice(["silu", "gelu_pytorch_tanh", "gelu_new"])
    if name == "argmax_rows":
        return (n(b, r.randint(1, 300)),)
    if name == "decode_attention":
        hkv, group, s = r.randint(1, 3), r.randint(1, 3), r.randint(1, 40)
        q, k, v = n(b, hkv * group, 1, d), n(b, hkv, s, d), n(b, hkv, s, d)
        scale, softcap, sinks = d**-0.5, r.choice([None, 5.0]), opt(n(hkv * group) * 2)
        if r.random() < 0.4:
            return q, k, v, torch.rand(b, 1, s, generator=g) < 0.7, None, None, "full", 0, scale, softcap, sinks
        qpos = torch.randint(-1, 60, (b, 1), generator=g)
        kpos = torch.randint(-1, 60, (b, s), generator=g)
        pattern = r.choice(["full", "sliding", "chunked"])
        return q, k, v, None, qpos, kpos, pattern, r.randint(1, 20), scale, softcap, sinks
    if name in ("rope", "norm_rope"):
        h = r.randint(1, 3)
        cos, sin = _cos_sin(r, g, b, t, d)
        if name == "rope":
            return n(b, h, t, d), cos, sin, r.random() < 0.5
        if r.random() < 0.3:
            cos = sin = None
        return n(b, h, t, d), opt(n(d)), 1e-6, cos, sin, r.random() < 0.5
    if name == "selective_scan":
        dm, st_n = r.randint(1, 6), r.randint(1, 5)
        return (
            *(n(b, t, dm), n(b, t, dm) * 0.5, opt(n(b, t, dm)), n(b, t, st_n), n(b, t, st_n)),
            *(-torch.rand(dm, st_n, generator=g), opt(n(dm)), opt(n(dm)), r.random() < 0.5, opt(n(b, dm, st_n))),
        )
    if name == "gated_mlp":
        i = r.randint(1, 24)
        (wg, sg), (wd, sd) = _weight(r, g, 2 * i, d), _weight(r, g, d, i)
        act = r.choice(["silu", "gelu_pytorch_tanh"])
        return n(b, r.randint(1, 2), d), wg, opt(n(2 * i)), sg, wd, opt(n(d)), sd, act
    if name == "qkv_norm_rope":
        hkv, group, hd = r.randint(1, 2), r.randint(1, 2), r.choice([2, 4, 8])
        w, ws = _weight(r, g, (hkv * group + 2 * hkv) * hd, d)
        cos, sin = _cos_sin(r, g, b, t, hd) if r.random() < 0.7 else (None, None)
        return (
            n(b, t, d),
            w,
            opt(n(w.shape[0])),
            ws,
            hkv * group,
            hkv,
            hd,
            opt(n(hd)),
            1e-6,
            opt(n(hd)),
            1e-6,
            cos,
            sin,
            r.random() < 0.5,
            *((n(d), 1e-5) if r.random() < 0.5 else ()),  # the layer's input norm (or the defaults: none)
        )
    if name == "decoder_tail":
        width, i = r.randint(1, 20), r.randint(1, 24)
        (wo, so), (wg, sg), (wd, sd) = _weight(r, g, d, width), _weight(r, g, 2 * i, d), _weight(r, g, d, i)
        rows = (b, r.randint(1, 2))
        norm = lambda: (n(d), r.choice([1e-6, 1e-2])) if r.random() < 0.6 else (None, 0.0)  # noqa: E731
        act = r.choice(["silu", "gelu_pytorch_tanh"])
        return (
            *(n(*rows, d), n(*rows, width), wo, opt(n(d)), so, *norm(), *norm()),
            *(wg, opt(n(2 * i)), sg, wd, opt(n(d)), sd, act, *norm()),
        )
    if name == "attention_step":
        hkv, group, hd, s = r.randint(1, 2), r.randint(1, 2), r.choice([2, 4, 8]), r.randint(1, 30)
        w, ws = _weight(r, g, (hkv * group + 2 * hkv) * hd, d)
        cos, sin = _cos_sin(r, g, b, 1, hd) if r.random() < 0.7 else (None, None)
        kpos = torch.arange(s).repeat(b, 1) - torch.randint(0, 3, (b, 1), generator=g)  # left padding
        qs, ks, ins = opt(n(hd)), opt(n(hd)), opt(n(d))
        return (
            *(n(b, 1, d), w, opt(n(w.shape[0])), ws, hkv * group, hkv, hd, qs, 1e-6, ks, 1e-6, cos, sin),
            *(r.random() < 0.5, ins, 1e-5, n(b, hkv, s, hd), n(b, hkv, s, hd), r.randint(0, s - 1), kpos[:, -1:]),
            *(kpos, r.choice(["full", "sliding", "chunked"]), r.randint(1, 20), hd**-0.5, r.choice([None, 5.0])),
            opt(n(hkv * group)),
        )
    if name == "decoder_layer":  # the attention step's arguments, then a decoder tail that fits them
        step = sample("attention_step", seed)
        d, width, i = step[0].shape[-1], step[4] * step[6], r.randint(1, 24)
        (wo, so), (wg, sg), (wd, sd) = _weight(r, g, d, width), _weight(r, g, 2 * i, d), _weight(r, g, d, i)
        norm = lambda: (n(d), r.choice([1e-6, 1e-2])) if r.random() < 0.6 else (None, 0.0)  # noqa: E731
        act = r.choice(["silu", "gelu_pytorch_tanh"])
        return (*step, wo, opt(n(d)), so, *norm(), *norm(), wg, opt(n(2 * i)), sg, wd, opt(n(d)), sd, act, *norm())
    raise AssertionError(name)


def _strides(t):
    """The strides that matter: those of dims of more than one element."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def _outs(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_every_spec_has_a_sample_and_a_reference():
    assert set(NAMES) == set(REFERENCES) and len(NAMES) == 15
    for name in NAMES:
        sample(name, 0)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_eager_equals_compiled_equals_reference(name, seed):
    args = sample(name, seed)
    eager = _outs(op(name)(*args))
    torch._dynamo.reset()
    counters.clear()
    compiled = _outs(torch.compile(lambda *a: op(name)(*a), fullgraph=True, backend="aot_eager")(*args))
    assert not counters["graph_break"], dict(counters["graph_break"])
    wrapper = KERNELS[name](*args)  # what eager callers run: the C kernel, or None (their torch path)
    if wrapper is not None:
        assert all(torch.equal(a, b) for a, b in zip(eager, _outs(wrapper)))
    want = _outs(REFERENCES[name](*args))
    assert len(eager) == len(compiled) == len(want)
    for e, c, w in zip(eager, compiled, want):
        assert torch.equal(e, c)  # the same kernel (or the same reference) runs under compile
        assert e.shape == w.shape and e.dtype == w.dtype
        if e.dtype == torch.int64:  # argmax: ties may break differently only on equal values
            assert torch.equal(e, w)
        else:
            torch.testing.assert_close(e, w.contiguous(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_fake_outputs_match_real(name):
    for seed in range(4):
        args = sample(name, seed)
        real = _outs(op(name)(*args))
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fake = _outs(op(name)(*fake_args))
        assert [(f.shape, f.dtype, _strides(f)) for f in fake] == [(x.shape, x.dtype, _strides(x)) for x in real]


def test_inductor_compiles_the_ops_into_one_graph():
    """The real backend, as compiled decode uses it: a projection, a norm and an argmax in one graph."""
    args = sample("decode_linear", 3)
    norm = torch.ones(args[1].shape[0])

    def step(x):
        y = op("decode_linear")(x, *args[1:])
        return op("argmax_rows")(op("rms_norm")(y, norm, 1e-6).flatten(0, -2))

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(step, fullgraph=True)(args[0])
    assert not counters["graph_break"]
    assert torch.equal(got, step(args[0]))


class _NoC:
    def __getattr__(self, name):
        raise AssertionError(f"C function {name} reached with arguments the declared rules refuse")


BAD = {  # op -> (argument index, a replacement that breaks a declared rule, what the message names)
    "decode_linear": [(0, lambda a: a.double(), "x must be"), (1, lambda w: w[:, :-1], "K")],
    "decode_linear_q8_0": [
        (3, lambda s: s.float(), "scale must be"),  # a per-row-int8-like scale
        (1, lambda w: w.float(), "weight must be"),
        (3, lambda s: torch.cat([s, s[:, :1]], 1), "q8_0 needs K = 32 x"),  # K not 32 x the blocks
        (1, lambda w: w[:, :-16].contiguous(), "K"),  # in_features not a multiple of 32
    ],
    "rms_norm": [(1, lambda s: torch.ones(s.shape[0] + 1), "D"), (0, lambda x: x.half(), "x must be")],
    "residual_norm": [(1, lambda x: x[..., :1].expand(*x.shape[:-1], 2).clone(), "D")],
    "act_mul": [(1, lambda a: "relu", "activation"), (0, lambda x: x[..., :-1], "odd width")],
    "argmax_rows": [(0, lambda x: x[:, :0], "empty"), (0, lambda x: x[0], "[B V]")],
    "decode_attention": [
        (0, lambda q: q.repeat(1, 1, 2, 1), "1"),
        (7, lambda p: 0, ">= 1"),
        (10, lambda s: torch.zeros(99), "Hq"),
    ],
    "rope": [(1, lambda c: torch.ones(*c.shape[:-1], 3), "R = "), (0, lambda x: x.to(torch.bfloat16), "x must be")],
    "norm_rope": [(4, lambda s: None, "both or neither")],
    "selective_scan": [(5, lambda a: a[:, :1].expand(-1, 7).clone(), "N"), (0, lambda u: u.double(), "u must be")],
    "gated_mlp": [
        (7, lambda a: "tanh", "activation"),
        (4, lambda w: w.t().contiguous(), "Dm"),
        (3, lambda s: torch.ones(99, 1, dtype=torch.float16), "G"),  # a q8_0-shaped scale of the wrong rows
    ],
    "qkv_norm_rope": [(4, lambda h: h + 1, "rows"), (7, lambda s: torch.ones(3), "head_dim")],
    "decoder_tail": [(15, lambda a: "tanh", "activation"), (1, lambda a: a[..., :1].repeat(2, 1, 1), "leading")],
    "attention_step": [
        (18, lambda slot: -1, "slot"),
        (21, lambda p: "ring", "unknown attention pattern"),
        (6, lambda hd: hd * 2, "do not match"),
        (0, lambda x: x.repeat(1, 2, 1), "1"),
    ],
    "decoder_layer": [
        (18, lambda slot: 10**6, "slot"),
        (26, lambda w: w[:, :-1].contiguous(), "reads"),  # o_proj's input width
        (39, lambda a: "tanh", "activation"),
    ],
}


@pytest.mark.parametrize("name", NAMES)
def test_broken_rules_raise_before_c(name, monkeypatch):
    monkeypatch.setattr(cpu_library, "_state", {"lib": _NoC()})
    seed = {"decode_attention": 1, "norm_rope": 5}.get(name, 0)
    args = sample(name, seed)
    if name == "decode_attention":  # the positions form, so the pattern's parameter counts
        while args[3] is not None or args[6] == "full":
            seed += 1
            args = sample(name, seed)
    if name == "norm_rope":
        while args[3] is None:
            seed += 1
            args = sample(name, seed)
    for i, bad, words in BAD[name]:
        broken = list(args)
        broken[i] = bad(args[i])
        with pytest.raises(accel.KernelArgumentError, match=words):
            op(name)(*broken)


def test_exports():
    assert accel.kernel_status().startswith(("C kernels", "torch path"))
    assert issubclass(accel.KernelArgumentError, ValueError)

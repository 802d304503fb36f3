"""The fused CPU kernels around a decoder layer's branches (residual add + norms, gated activations) against float64
formulas, and the modules that call them against their own torch paths."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache.accel.native.kernels as ck
from hybridcache.nn import GatedMLP, RMSNorm, residual_norm
from hybridcache.nn.core.linear_group import LinearGroup


@pytest.fixture(autouse=True)
def _kernel():
    if ck._library() is None:
        pytest.skip(f"no CPU kernel here: {ck.kernel_status()}")


def _norm64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9), d=st.integers(1, 70), post=st.booleans(), nxt=st.booleans(), seed=st.integers(0, 2**31 - 1)
)
def test_residual_norm_matches_float64(rows, d, post, nxt, seed):
    g = torch.Generator().manual_seed(seed)
    h, x = torch.randn(rows, d, generator=g) * 3, torch.randn(rows, d, generator=g) * 2
    wp, wn = torch.randn(d, generator=g), torch.randn(d, generator=g)
    with torch.no_grad():
        out = ck.residual_norm(h, x, (wp, 1e-6) if post else None, (wn, 1e-2) if nxt else None)
    assert out is not None
    want_h = h.double() + (_norm64(x, wp, 1e-6) if post else x.double())
    torch.testing.assert_close(out[0].double(), want_h, rtol=1e-5, atol=1e-5)
    if nxt:  # the second norm reads the float32 sum the kernel returned
        torch.testing.assert_close(out[1].double(), _norm64(out[0], wn, 1e-2), rtol=1e-5, atol=1e-6)
    else:
        assert out[1] is None


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    inner=st.integers(1, 70),
    act=st.sampled_from(sorted(ck.ACT_MUL)),
    seed=st.integers(0, 2**31 - 1),
)
def test_act_mul_matches_float64(rows, inner, act, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inner, generator=g) * 4
    with torch.no_grad():
        out = ck.act_mul(gate_up, act)
    gate, up = gate_up.double().chunk(2, dim=-1)
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    torch.testing.assert_close(out.double(), fn(gate) * up, rtol=1e-5, atol=1e-6)


def test_act_mul_keeps_extremes_finite():
    gate_up = torch.tensor([[-200.0, -50.0, 0.0, 50.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    with torch.no_grad():
        for act in ck.ACT_MUL:
            out = ck.act_mul(gate_up, act)
            torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0, 50.0, 200.0]]), atol=1e-6, rtol=0)


def test_residual_norm_module_path_equals_the_kernel_path():
    """The helper gives the kernel's result for plain RMSNorms and the modules' own results (another norm class,
    autograd on) otherwise: the same numbers up to float32 rounding."""
    torch.manual_seed(0)
    post, nxt = RMSNorm(24, 1e-6, unit_offset=True), RMSNorm(24, 1e-5)
    with torch.no_grad():
        post.weight.normal_(), nxt.weight.normal_()
    h, x = torch.randn(2, 3, 24), torch.randn(2, 3, 24)
    with torch.no_grad():
        fused = residual_norm(h, x, post, nxt)
        plain_h = h + post(x)
        torch.testing.assert_close(fused[0], plain_h)
        torch.testing.assert_close(fused[1], nxt(plain_h))
    with torch.enable_grad():  # the torch path
        slow = residual_norm(h, x, post, nxt)
    torch.testing.assert_close(slow[0].detach(), fused[0])
    torch.testing.assert_close(slow[1].detach(), fused[1])
    with torch.no_grad():
        h2, none = residual_norm(h, x, None, None)
    assert none is None and torch.equal(h2, h + x)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "relu"])
def test_gated_mlp_fused_equals_unfused(act):
    """A fused gate/up projection through the act-mul kernel (relu: the torch path) equals the three separate
    projections and torch's activation."""
    torch.manual_seed(0)
    mlp = GatedMLP(16, 40, act)
    x = torch.randn(3, 2, 16)
    with torch.no_grad():
        plain = mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert isinstance(mlp.gate_up, LinearGroup) and mlp.gate_up.fuse()
        torch.testing.assert_close(mlp(x), plain, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    n=st.sampled_from([1, 7, 16, 33, 100, 40_000]),
    ties=st.booleans(),
    special=st.sampled_from([None, "nan", "-inf", "inf"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_argmax_rows_is_torchs_argmax(rows, n, ties, special, seed):
    """The first largest value's index, the first NaN's if there is one (what torch.argmax answers), on rows long
    enough to be split over threads too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, n), generator=g).float() if ties else torch.randn(rows, n, generator=g)
    if special is not None:
        where = torch.randint(0, n, (rows, 3), generator=g)
        x.scatter_(1, where, float(special))
    with torch.no_grad():
        out = ck.argmax_rows(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(-1))


def test_argmax_rows_all_minus_infinity_and_nan_rows():
    x = torch.full((2, 50_000), float("-inf"))
    x[1, 40_000] = float("nan")
    x[1, 45_000] = float("nan")
    with torch.no_grad():
        assert ck.argmax_rows(x).tolist() == [0, 40_000] == x.argmax(-1).tolist()


from hybridcache.accel.native import fused as cpu_fused  # noqa: E402
from hybridcache.nn.core.linear import pack_matrix  # noqa: E402


def _packed(w, fmt):
    return (w, None) if fmt == "float32" else pack_matrix(w, fmt)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_gated_mlp_in_one_call_is_the_separate_calls(fmt, rows):
    """One call runs the same kernels in the same order as the three separate calls: bit-identical outputs
    (each of those kernels is checked against float64 above and in test_cpu_kernels.py)."""
    torch.manual_seed(rows)
    d, inner = 40, 24
    w_gu, s_gu = _packed(torch.randn(2 * inner, d), fmt)
    w_dn, s_dn = _packed(torch.randn(d, inner), fmt)
    b_dn = torch.randn(d)
    x = torch.randn(rows, 1, d)
    with torch.no_grad():
        fused = cpu_fused.gated_mlp(x, (w_gu, None, s_gu), (w_dn, b_dn, s_dn), "gelu_pytorch_tanh")
        separate = ck.decode_linear(
            ck.act_mul(ck.decode_linear(x, w_gu, None, s_gu), "gelu_pytorch_tanh"), w_dn, b_dn, s_dn
        )
    assert fused is not None and torch.equal(fused, separate)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("norms, rotary", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("in_norm", [False, True])
def test_qkv_norm_rope_in_one_call_is_the_separate_calls(fmt, norms, rotary, in_norm):
    torch.manual_seed(0)
    b, t, dm, hq, hkv, d = 2, 1, 48, 4, 2, 16
    w, s = _packed(torch.randn((hq + 2 * hkv) * d, dm), fmt)
    bias = torch.randn((hq + 2 * hkv) * d)
    x = torch.randn(b, t, dm)
    qs, ks = torch.randn(d), torch.randn(d)
    cos, sin = (torch.randn(b, 1, t, 8), torch.randn(b, 1, t, 8)) if rotary else (None, None)
    x_norm = (torch.randn(dm), 1e-6) if in_norm else None
    with torch.no_grad():
        q, k, v = cpu_fused.qkv_norm_rope(
            x,
            (w, bias, s),
            *(hq, hkv, d, (qs, 1e-6) if norms else None, (ks, 1e-5) if norms else None, cos, sin, False, x_norm),
        )
        qkv = ck.decode_linear(x if x_norm is None else ck.rms_norm(x, *x_norm), w, bias, s)
        qp, kp, vp = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        heads = lambda p, h: p.view(b, t, h, d).transpose(1, 2)  # noqa: E731
        q_ref = ck.norm_rope(heads(qp, hq), qs if norms else None, 1e-6, cos, sin, False)
        k_ref = ck.norm_rope(heads(kp, hkv), ks if norms else None, 1e-5, cos, sin, False)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, heads(vp, hkv))


def test_fused_paths_decline_what_they_do_not_take():
    x = torch.randn(17, 8)  # more rows than a decode step
    w = torch.randn(12, 8)
    with torch.no_grad():
        assert cpu_fused.gated_mlp(x, (w, None, None), (torch.randn(8, 6), None, None), "silu") is None
        assert cpu_fused.gated_mlp(x[:2], (w, None, None), (torch.randn(8, 6), None, None), "relu") is None
        assert (
            cpu_fused.qkv_norm_rope(torch.randn(1, 17, 8), (w, None, None), 1, 1, 4, None, None, None, None, False)
            is None
        )
    with torch.enable_grad():
        assert cpu_fused.gated_mlp(x[:2], (w, None, None), (torch.randn(8, 6), None, None), "silu") is None


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("norms", ["sandwich", "pre", "none"])
def test_decoder_tail_in_one_call_is_the_separate_calls(fmt, rows, norms):
    """o_proj, the residual add between norms, the gated MLP and its residual add in one call: bit-identical to the
    four separate calls (Gemma 3's sandwich norms; Llama's pre-MLP norm only; no norms)."""
    torch.manual_seed(rows)
    d, width, inner = 40, 24, 36
    w_o, s_o = _packed(torch.randn(d, width), fmt)
    w_gu, s_gu = _packed(torch.randn(2 * inner, d), fmt)
    w_dn, s_dn = _packed(torch.randn(d, inner), fmt)
    b_o, b_gu = torch.randn(d), torch.randn(2 * inner)
    scale = lambda: (torch.randn(d), 1e-6)  # noqa: E731
    post_attn, post_mlp = (scale(), scale()) if norms == "sandwich" else (None, None)
    pre_mlp = scale() if norms != "none" else None
    h, a = torch.randn(rows, 1, d) * 3, torch.randn(rows, 1, width)
    with torch.no_grad():
        fused = cpu_fused.decoder_tail(
            h, a, (w_o, b_o, s_o), post_attn, pre_mlp, (w_gu, b_gu, s_gu), (w_dn, None, s_dn), "silu", post_mlp
        )
        h1, x = ck.residual_norm(h, ck.decode_linear(a, w_o, b_o, s_o), post_attn, pre_mlp)
        m = cpu_fused.gated_mlp(h1 if pre_mlp is None else x, (w_gu, b_gu, s_gu), (w_dn, None, s_dn), "silu")
        separate = ck.residual_norm(h1, m, post_mlp, None)[0]
    assert fused is not None and torch.equal(fused, separate)


def test_decoder_tail_declines_what_it_does_not_take():
    d, width, inner = 8, 6, 5
    o, gu = (torch.randn(d, width), None, None), (torch.randn(2 * inner, d), None, None)
    dn = (torch.randn(d, inner), None, None)
    norm = (torch.randn(d), 1e-6)
    args = lambda h, a: (h, a, o, norm, norm, gu, dn, "silu", norm)  # noqa: E731
    with torch.no_grad():
        assert cpu_fused.decoder_tail(*args(torch.randn(1, d), torch.randn(1, width))) is not None
        assert cpu_fused.decoder_tail(*args(torch.randn(17, d), torch.randn(17, width))) is None  # a prefill
        assert cpu_fused.decoder_tail(*args(torch.randn(2, d), torch.randn(3, width))) is None  # rows differ
        assert cpu_fused.decoder_tail(*args(torch.randn(1, d).double(), torch.randn(1, width))) is None
        bad = list(args(torch.randn(1, d), torch.randn(1, width)))
        bad[7] = "relu"
        assert cpu_fused.decoder_tail(*bad) is None
        bad[7], bad[3] = "silu", (torch.randn(d + 1), 1e-6)
        assert cpu_fused.decoder_tail(*bad) is None
    with torch.enable_grad():
        assert cpu_fused.decoder_tail(*args(torch.randn(1, d), torch.randn(1, width))) is None

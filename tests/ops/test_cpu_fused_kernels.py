"""The fused CPU kernels around a decoder layer's branches (residual add + norms, gated activations) against float64
formulas, and the modules that call them against their own torch paths."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache.ops.cpu_kernels as ck
from hybridcache.blocks import GatedMLP, RMSNorm, residual_norm
from hybridcache.blocks.linear_group import LinearGroup


@pytest.fixture(autouse=True)
def _kernel():
    if ck._library() is None:
        pytest.skip(f"no CPU kernel here: {ck.kernel_status()}")


def _norm64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), d=st.integers(1, 70), post=st.booleans(), nxt=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
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
@given(rows=st.integers(1, 5), inner=st.integers(1, 70), act=st.sampled_from(sorted(ck.ACT_MUL)),
       seed=st.integers(0, 2**31 - 1))
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
@given(rows=st.integers(1, 9), n=st.sampled_from([1, 7, 16, 33, 100, 40_000]), ties=st.booleans(),
       special=st.sampled_from([None, "nan", "-inf", "inf"]), seed=st.integers(0, 2**31 - 1))
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

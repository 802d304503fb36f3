"""The recurrent mixers' one-call decode steps (accel/native/steps/recurrent.py, csrc/recurrent_step.c) against the
pure-torch ops the reference modules run (causal_conv1d_step, ssd_step, the gated RMSNorm, F.linear) or, for Mamba1,
the selective step written out in torch, on random weights and states: LFM2's short conv, the Mamba2 mixer (groups,
each gate, biases, dt limits, int8 / bfloat16 / q8_0 weights), the Mamba1 mixer (with and without Jamba's inner norms),
Qwen3-Next's Gated DeltaNet (against the ops' gated_delta_step).
Tolerance: float32 noise (1e-5 relative; the kernels sum in another order than torch's einsum). Hostile sizes are
refused by name before any C call; what the kernel does not take (float64) is left to the reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridcache.accel import kernel_status
from hybridcache.accel.native.checks import KernelArgumentError
from hybridcache.accel.native.steps.recurrent import gated_delta_step, mamba2_step, mamba_step, short_conv_step
from hybridcache.ops import causal_conv1d_step, q8_0, ssd_step
from hybridcache.ops import gated_delta_step as delta_rule_step

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # the kernels serve inference only (with autograd on they decline)
        yield


def _proj(rows, cols, g, fmt="float32", bias=False):
    """(weight, bias, scale) as a DecodeLinear holds them, and the float32 matrix they stand for."""
    w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
    b = torch.randn(rows, generator=g) * 0.1 if bias else None
    if fmt == "int8":
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).to(torch.int8)
        return (q, b, scale), q.float() * scale[:, None]
    if fmt == "bfloat16":
        wb = w.to(torch.bfloat16)
        return (wb, b, None), wb.float()
    if fmt == "q8_0":  # llama.cpp's blocks: the activations are quantized too (q8_0.linear, the torch recompute)
        q, scale = q8_0.pack(w)
        return (q, b, scale), None
    return (w, b, None), w


def _lin(x, dense, parts):
    if dense is None:
        return q8_0.linear(x, parts[0], parts[2], parts[1])
    y = F.linear(x, dense)
    return y if parts[1] is None else y + parts[1]


@pytest.mark.parametrize("fmt", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch,d,k", [(1, 16, 3), (3, 40, 4), (2, 8, 2)])
def test_short_conv_step_matches_the_ops(batch, d, k, bias, fmt):
    g = torch.Generator().manual_seed(batch * 100 + d + k)
    x = torch.randn(batch, 1, d, generator=g)
    in_proj, w_in = _proj(3 * d, d, g, fmt, bias)
    out_proj, w_out = _proj(d, d, g, fmt, bias)
    conv_w = torch.randn(d, k, generator=g)
    conv_b = torch.randn(d, generator=g) if bias else None
    state = torch.randn(batch, d, k - 1, generator=g)
    before = state.clone()
    y, new_state = short_conv_step(x, in_proj, conv_w, conv_b, state, out_proj)
    b_, c_, u = _lin(x, w_in, in_proj).chunk(3, dim=-1)
    conv, ref_state = causal_conv1d_step((b_ * u)[:, 0], conv_w, conv_b, state)
    ref = _lin(c_ * conv[:, None], w_out, out_proj)
    torch.testing.assert_close(y, ref, **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)  # (b * u from another matmul: not bit-equal)
    assert torch.equal(state, before)  # the old state is read, never written


def _mamba2_ref(x, sizes, in_dense, in_proj, conv_w, conv_b, conv_state, dt_bias, a_log, d_skip, limit, ssm, gate,
                norm, out_dense, out_proj):  # fmt: skip
    h, p, g, n = sizes
    i = h * p
    z, xbc, dt = _lin(x, in_dense, in_proj)[:, 0].split([i, i + 2 * g * n, h], dim=-1)
    xbc, new_conv = causal_conv1d_step(xbc, conv_w, conv_b, conv_state, "silu")
    u, bm, cm = xbc.split([i, g * n, g * n], dim=-1)
    y, new_ssm = ssd_step(
        ssm, u.reshape(-1, h, p), dt, -torch.exp(a_log), bm.reshape(-1, g, n), cm.reshape(-1, g, n), d_skip,
        dt_bias=dt_bias, dt_softplus=True, dt_limit=limit,
    )  # fmt: skip
    y = y.reshape(-1, i)
    if gate == "silu":
        out = y * F.silu(z)
    else:
        v = y * F.silu(z) if gate == "norm_after_gate" else y
        vg = v.reshape(v.shape[0], g, i // g)
        v = (vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + norm[1])).reshape(-1, i)
        out = norm[0] * (v * F.silu(z) if gate == "norm_before_gate" else v)
    return _lin(out[:, None], out_dense, out_proj), new_conv, new_ssm


CASES = [  # batch, (H, P, G, N), K, dm, gate, bias, limit, fmt
    (1, (4, 8, 1, 16), 4, 24, "norm_after_gate", False, (0.0, math.inf), "float32"),
    (2, (6, 4, 2, 8), 3, 16, "norm_before_gate", True, (0.0, 0.5), "float32"),
    (3, (4, 4, 4, 20), 4, 12, "silu", True, (0.01, 2.0), "int8"),
    (2, (8, 16, 2, 32), 4, 32, "norm_after_gate", False, (0.0, math.inf), "bfloat16"),
    (1, (4, 8, 1, 16), 4, 64, "norm_after_gate", True, (0.0, math.inf), "q8_0"),
]


@pytest.mark.parametrize("batch,sizes,k,dm,gate,bias,limit,fmt", CASES)
def test_mamba2_step_matches_the_ops(batch, sizes, k, dm, gate, bias, limit, fmt):
    g = torch.Generator().manual_seed(sum(sizes) + batch)
    h, p, gr, n = sizes
    i, cc = h * p, h * p + 2 * gr * n
    x = torch.randn(batch, 1, dm, generator=g)
    in_proj, in_dense = _proj(2 * i + 2 * gr * n + h, dm, g, fmt, bias)
    out_proj, out_dense = _proj(dm, i, g, fmt, bias)
    conv_w, conv_b = torch.randn(cc, k, generator=g) * 0.5, (torch.randn(cc, generator=g) if bias else None)
    conv_state, ssm = torch.randn(batch, cc, k - 1, generator=g), torch.randn(batch, h, p, n, generator=g)
    dt_bias, a_log, d_skip = torch.randn(h, generator=g), torch.randn(h, generator=g), torch.randn(h, generator=g)
    norm = None if gate == "silu" else (torch.randn(i, generator=g), 1e-5)
    args = (conv_w, conv_b, conv_state, dt_bias, a_log, d_skip, limit, ssm, gate, norm)
    before = (conv_state.clone(), ssm.clone())
    y, new_conv, new_ssm = mamba2_step(x, sizes, in_proj, *args, out_proj)
    ref, ref_conv, ref_ssm = _mamba2_ref(x, sizes, in_dense, in_proj, *args, out_dense, out_proj)
    torch.testing.assert_close(new_conv, ref_conv, **TOL)
    torch.testing.assert_close(new_ssm, ref_ssm, **TOL)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)  # (through a group RMSNorm of a sum of N products)
    assert torch.equal(conv_state, before[0]) and torch.equal(ssm, before[1])


def _mamba2_args(batch=2):
    sizes = (4, 4, 2, 8)
    i, cc = 16, 16 + 32
    return dict(
        x=torch.randn(batch, 1, 12),
        sizes=sizes,
        in_proj=(torch.randn(2 * i + 32 + 4, 12), None, None),
        conv_w=torch.randn(cc, 4),
        conv_b=None,
        conv_state=torch.zeros(batch, cc, 3),
        dt_bias=torch.zeros(4),
        a_log=torch.zeros(4),
        d_skip=None,
        dt_limit=(0.0, math.inf),
        ssm_state=torch.zeros(batch, 4, 4, 8),
        gate="silu",
        norm=None,
        out_proj=(torch.randn(12, i), None, None),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(conv_state=torch.zeros(2, 48, 2)), "conv state"),
        (dict(ssm_state=torch.zeros(2, 4, 4, 9)), "state"),
        (dict(in_proj=(torch.randn(10, 12), None, None)), "in_proj"),
        (dict(out_proj=(torch.randn(12, 15), None, None)), "out_proj"),
        (dict(sizes=(4, 4, 3, 8)), "groups"),
        (dict(sizes=(4, 4, 0, 8)), "positive"),
        (dict(gate="relu"), "gate"),
        (dict(dt_limit=(0.0, float("nan"))), "dt_limit"),
        (dict(conv_w=torch.randn(47, 4)), "conv weight"),
        (dict(x=torch.randn(2, 1, 13)), "in_proj weight must be \\[68, 13\\]"),
    ],
)
def test_mamba2_step_refuses_hostile_sizes_by_name(change, match):
    with pytest.raises(KernelArgumentError, match=match):
        mamba2_step(**{**_mamba2_args(), **change})


def test_short_conv_step_refuses_hostile_sizes_by_name():
    x, w = torch.randn(1, 1, 8), (torch.randn(24, 8), None, None)
    out = (torch.randn(8, 8), None, None)
    with pytest.raises(KernelArgumentError, match="conv state"):
        short_conv_step(x, w, torch.randn(8, 3), None, torch.zeros(1, 8, 3), out)
    with pytest.raises(KernelArgumentError, match="in_proj"):
        short_conv_step(x, (torch.randn(23, 8), None, None), torch.randn(8, 3), None, torch.zeros(1, 8, 2), out)
    with pytest.raises(KernelArgumentError, match="width"):
        short_conv_step(x, w, torch.randn(8, 1), None, torch.zeros(1, 8, 0), out)


def test_what_the_kernels_do_not_take_goes_to_the_reference():
    args = _mamba2_args()
    assert mamba2_step(**{**args, "x": args["x"].double()}) is None  # float64
    assert mamba2_step(**{**args, "x": torch.randn(2, 3, 12)}) is None  # a prefill block
    assert mamba2_step(**{**args, "ssm_state": args["ssm_state"].to(torch.bfloat16)}) is None  # bf16 state
    x = torch.randn(1, 1, 8)
    w, out = (torch.randn(24, 8), None, None), (torch.randn(8, 8), None, None)
    assert short_conv_step(x.double(), w, torch.randn(8, 3), None, torch.zeros(1, 8, 2), out) is None


def _rms(v, scale, eps):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * scale


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize(
    "batch,dm,di,n,k,r,norms,bias", [(1, 12, 24, 8, 4, 3, False, True), (3, 16, 32, 16, 3, 2, True, False)]
)
def test_mamba_step_matches_the_selective_step_in_torch(batch, dm, di, n, k, r, norms, bias, fmt):
    g = torch.Generator().manual_seed(di + n + k)
    x = torch.randn(batch, 1, dm, generator=g)
    in_proj, w_in = _proj(2 * di, dm, g, fmt, bias)
    x_proj, w_x = _proj(r + 2 * n, di, g, fmt, False)
    dt_parts, w_dt = _proj(di, r, g, fmt, False)
    dt_bias = torch.randn(di, generator=g) * 0.5
    dt_proj = (dt_parts[0], dt_bias, dt_parts[2])
    out_proj, w_out = _proj(dm, di, g, fmt, bias)
    conv_w, conv_b = torch.randn(di, k, generator=g) * 0.5, (torch.randn(di, generator=g) if bias else None)
    conv_state, ssm = torch.randn(batch, di, k - 1, generator=g), torch.randn(batch, di, n, generator=g)
    a_log, d_skip = torch.randn(di, n, generator=g) * 0.5, torch.randn(di, generator=g)
    inner = tuple((torch.rand(w, generator=g) + 0.5, 1e-6) for w in (r, n, n)) if norms else None
    before = (conv_state.clone(), ssm.clone())
    y, new_conv, new_ssm = mamba_step(
        x, in_proj, conv_w, conv_b, conv_state, x_proj, inner, dt_proj, a_log, d_skip, ssm, out_proj
    )
    # the oracle: Mamba1's step written out (HF MambaMixer.slow_forward's decode branch)
    u, z = _lin(x[:, 0], w_in, in_proj).chunk(2, dim=-1)
    window = torch.cat([conv_state, u[..., None]], dim=-1)  # [B, Di, K]
    u = F.silu((window * conv_w).sum(-1) + (conv_b if bias else 0))
    dt, bm, cm = F.linear(u, w_x).split([r, n, n], dim=-1)
    if norms:
        dt, bm, cm = (_rms(v, s_, e) for v, (s_, e) in zip((dt, bm, cm), inner, strict=True))
    delta = F.softplus(F.linear(dt, w_dt) + dt_bias)  # [B, Di]
    da = torch.exp(delta[..., None] * -torch.exp(a_log))  # [B, Di, N]
    h = da * ssm + (delta * u)[..., None] * bm[:, None]
    yy = (h * cm[:, None]).sum(-1) + d_skip * u
    ref = _lin((yy * F.silu(z))[:, None], w_out, out_proj)
    torch.testing.assert_close(new_conv, window[..., 1:], **TOL)
    torch.testing.assert_close(new_ssm, h, **TOL)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_state, before[0]) and torch.equal(ssm, before[1])


def test_mamba_step_refuses_hostile_sizes_by_name():
    x, a_log = torch.randn(1, 1, 8), torch.zeros(16, 4)
    good = dict(
        in_proj=(torch.randn(32, 8), None, None), conv_w=torch.randn(16, 4), conv_b=None,
        conv_state=torch.zeros(1, 16, 3), x_proj=(torch.randn(10, 16), None, None), inner_norms=None,
        dt_proj=(torch.randn(16, 2), torch.zeros(16), None), a_log=a_log, d_skip=None,
        ssm_state=torch.zeros(1, 16, 4), out_proj=(torch.randn(8, 16), None, None),
    )  # fmt: skip
    assert mamba_step(x, **good) is not None
    for change, match in [
        (dict(conv_w=torch.randn(15, 4)), "conv weight"),
        (dict(x_proj=(torch.randn(8, 16), None, None)), "x_proj"),
        (dict(ssm_state=torch.zeros(1, 16, 5)), "state"),
        (dict(dt_proj=(torch.randn(16, 3), None, None)), "dt_proj"),
        (dict(inner_norms=((None, 0.0),)), "inner_norms"),
    ]:
        with pytest.raises(KernelArgumentError, match=match):
            mamba_step(x, **{**good, **change})


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("batch,hk,hv,dk,dv,k,beta_scale", [(1, 2, 4, 8, 6, 4, 1.0), (3, 1, 3, 16, 8, 3, 2.0)])
def test_gated_delta_step_matches_the_ops(batch, hk, hv, dk, dv, k, beta_scale, fmt):
    g = torch.Generator().manual_seed(hk * 10 + hv + dk)
    r, dm = hv // hk, 20
    x = torch.randn(batch, 1, dm, generator=g)
    qkvz, w_qkvz = _proj(2 * hk * dk + 2 * hv * dv, dm, g, fmt)
    ba, w_ba = _proj(2 * hv, dm, g, fmt)
    out_proj, w_out = _proj(dm, hv * dv, g, fmt)
    cc = 2 * hk * dk + hv * dv
    conv_w, conv_state = torch.randn(cc, k, generator=g) * 0.5, torch.randn(batch, cc, k - 1, generator=g)
    rec = torch.randn(batch, hv, dk, dv, generator=g) * 0.3
    dt_bias, a_log = torch.randn(hv, generator=g), torch.randn(hv, generator=g) * 0.5
    norm = (torch.rand(dv, generator=g) + 0.5, 1e-6)
    before = (conv_state.clone(), rec.clone())
    y, new_conv, new_rec = gated_delta_step(
        x, (hk, hv, dk, dv), qkvz, ba, conv_w, conv_state, dt_bias, a_log, beta_scale, rec, norm, out_proj
    )
    # the oracle: HF's per-key-head layout split by hand, the ops' conv step and gated delta step
    p = _lin(x[:, 0], w_qkvz, qkvz).reshape(batch, hk, 2 * dk + 2 * r * dv)
    q, kk, v, z = p.split([dk, dk, r * dv, r * dv], dim=-1)
    ba_v = _lin(x[:, 0], w_ba, ba).reshape(batch, hk, 2 * r)
    b_, a_ = ba_v[..., :r].reshape(batch, hv), ba_v[..., r:].reshape(batch, hv)
    mixed = torch.cat([q.reshape(batch, -1), kk.reshape(batch, -1), v.reshape(batch, -1)], dim=-1)
    mixed, ref_conv = causal_conv1d_step(mixed, conv_w, None, conv_state, "silu")
    q, kk, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    beta = torch.sigmoid(b_) * beta_scale
    decay = -torch.exp(a_log) * F.softplus(a_ + dt_bias)
    o, ref_rec = delta_rule_step(
        rec, q.reshape(batch, hk, dk), kk.reshape(batch, hk, dk), v.reshape(batch, hv, dv), decay, beta,
        qk_l2norm=True,
    )  # fmt: skip
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0] * F.silu(z.reshape(batch, hv, dv))
    ref = _lin(o.reshape(batch, 1, hv * dv), w_out, out_proj)
    torch.testing.assert_close(new_conv, ref_conv, **TOL)
    torch.testing.assert_close(new_rec, ref_rec, **TOL)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_state, before[0]) and torch.equal(rec, before[1])


def test_gated_delta_step_refuses_hostile_sizes_by_name():
    x = torch.randn(1, 1, 8)
    good = dict(
        heads=(1, 2, 4, 4), qkvz=(torch.randn(24, 8), None, None), ba=(torch.randn(4, 8), None, None),
        conv_w=torch.randn(16, 4), conv_state=torch.zeros(1, 16, 3), dt_bias=torch.zeros(2), a_log=torch.zeros(2),
        beta_scale=1.0, rec_state=torch.zeros(1, 2, 4, 4), norm=(torch.ones(4), 1e-6),
        out_proj=(torch.randn(8, 8), None, None),
    )  # fmt: skip
    assert gated_delta_step(x, **good) is not None
    for change, match in [
        (dict(heads=(2, 3, 4, 4)), "heads"),
        (dict(conv_w=torch.randn(15, 4)), "conv weight"),
        (dict(qkvz=(torch.randn(23, 8), None, None)), "in_proj_qkvz"),
        (dict(rec_state=torch.zeros(1, 2, 4, 5)), "recurrent state"),
        (dict(beta_scale="2"), "beta_scale"),
    ]:
        with pytest.raises(KernelArgumentError, match=match):
            gated_delta_step(x, **{**good, **change})

"""Mamba2 ssd_scan / ssd_step vs a per-step, per-head oracle and HF's torch path."""

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import causal_conv1d, ssd_scan, ssd_step

ssd_mod = importlib.import_module("hybridcache.ops.ssd")


def naive_ssd(x, dt, A, B, C, D=None, dt_bias=None, softplus=False, dt_limit=(0.0, math.inf), state=None):
    """Python loops over time and heads, float64."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    bsz, t, nh, p = x.shape
    g, n = B.shape[2], B.shape[3]
    per_group = nh // g
    h = state.double().clone() if state is not None else torch.zeros(bsz, nh, p, n, dtype=torch.float64)
    y = torch.zeros(bsz, t, nh, p, dtype=torch.float64)
    for i in range(t):
        for hd in range(nh):
            d = dt[:, i, hd]
            if dt_bias is not None:
                d = d + float(dt_bias[hd])
            if softplus:
                d = torch.log1p(torch.exp(d))
            d = d.clamp(dt_limit[0], dt_limit[1])
            grp = hd // per_group
            h[:, hd] = (
                torch.exp(d * float(A[hd]))[:, None, None] * h[:, hd]
                + (d[:, None] * x[:, i, hd])[:, :, None] * B[:, i, grp][:, None, :]
            )
            y[:, i, hd] = (h[:, hd] * C[:, i, grp][:, None, :]).sum(-1)
            if D is not None:
                y[:, i, hd] += float(D[hd]) * x[:, i, hd]
    return y, h


def make(seed, bsz=2, t=9, nh=4, p=3, g=2, n=5, dtype=torch.float64, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(
        x=r(bsz, t, nh, p),
        dt=r(bsz, t, nh) * 0.5,
        A=-torch.rand(nh, generator=gen, dtype=dtype) * 2 - 0.1,
        B=r(bsz, t, g, n),
        C=r(bsz, t, g, n),
        D=r(nh),
        dt_bias=r(nh) * 0.3,
        state=r(bsz, nh, p, n) if with_state else None,
    )


def scan(kw, chunk_size=256, limit=(0.0, math.inf), **over):
    kw = {**kw, **over}
    return ssd_scan(
        kw["x"],
        kw["dt"],
        kw["A"],
        kw["B"],
        kw["C"],
        chunk_size=chunk_size,
        D=kw["D"],
        dt_bias=kw["dt_bias"],
        dt_softplus=True,
        dt_limit=limit,
        state=kw["state"],
    )


def oracle(kw, limit=(0.0, math.inf)):
    return naive_ssd(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["dt_bias"], True, limit, kw["state"])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bsz=st.integers(1, 2),
    t=st.integers(0, 12),
    g=st.sampled_from([1, 2]),
    per_group=st.integers(1, 3),
    p=st.integers(1, 3),
    n=st.integers(1, 4),
    chunk=st.sampled_from([1, 3, 7, 256]),
    with_state=st.booleans(),
    limit=st.sampled_from([(0.0, math.inf), (0.05, 0.6)]),
)
def test_matches_naive(seed, bsz, t, g, per_group, p, n, chunk, with_state, limit):
    kw = make(seed, bsz, t, g * per_group, p, g, n, with_state=with_state)
    y, h = scan(kw, chunk, limit)
    ry, rh = oracle(kw, limit)
    assert y.shape == (bsz, t, g * per_group, p) and h.shape == (bsz, g * per_group, p, n)
    torch.testing.assert_close(y, ry, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, rh, rtol=1e-10, atol=1e-10)


def test_chunk_sizes_agree_float32():
    kw = make(1, t=23, dtype=torch.float32)
    ry, rh = oracle(kw)
    outs = [scan(kw, c) for c in (1, 3, 7, 8, 256)]
    for y, h in outs:
        assert y.dtype == torch.float32 and h.dtype == torch.float32
        torch.testing.assert_close(y.double(), ry, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.double(), rh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, outs[0][0], rtol=1e-5, atol=1e-5)


def test_bf16_input_keeps_float32_state():
    kw = make(2, t=10, dtype=torch.float32)
    half = {k: (v.bfloat16() if k in ("x", "dt", "B", "C") else v) for k, v in kw.items()}
    y, h = scan(half, 4)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    ry, _ = scan(kw, 4)
    torch.testing.assert_close(y.float(), ry, rtol=5e-2, atol=5e-2)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(0, 13),
    cuts=st.lists(st.integers(0, 13), max_size=4),
    chunk=st.sampled_from([1, 4, 256]),
)
def test_random_splits_equal_one_call(seed, t, cuts, chunk):
    kw = make(seed, t=t)
    y_full, h_full = scan(kw, chunk)
    bounds = sorted({0, t, *[min(c, t) for c in cuts]})
    state, ys = kw["state"], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = {k: (v[:, lo:hi] if k in ("x", "dt", "B", "C") else v) for k, v in kw.items()}
        y, state = scan(part, chunk, state=state)
        ys.append(y)
    if ys:
        torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state, h_full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.1, 0.4)])
def test_steps_equal_scan_and_do_not_mutate(limit):
    kw = make(3, t=7)
    y_full, h_full = scan(kw, 3, limit)
    state = kw["state"]
    for i in range(7):
        before = state.clone()
        y, new = ssd_step(
            state,
            kw["x"][:, i],
            kw["dt"][:, i],
            kw["A"],
            kw["B"][:, i],
            kw["C"][:, i],
            D=kw["D"],
            dt_bias=kw["dt_bias"],
            dt_softplus=True,
            dt_limit=limit,
        )
        torch.testing.assert_close(state, before, rtol=0, atol=0)
        torch.testing.assert_close(y, y_full[:, i], rtol=1e-10, atol=1e-10)
        state = new
    torch.testing.assert_close(state, h_full, rtol=1e-10, atol=1e-10)


def test_segsum():
    a = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    s = ssd_mod._segsum(a)
    for i in range(4):
        for j in range(4):
            expect = a[j + 1 : i + 1].sum() if i >= j else -math.inf
            assert float(s[i, j]) == pytest.approx(float(expect))


def test_matches_hf_chunk_scan_and_step():
    from transformers.models.mamba2 import modeling_mamba2 as hf

    kw = make(4, t=10, dtype=torch.float32)
    y, h = scan(kw, 4)
    y_hf, h_hf = hf.mamba2_chunk_scan(
        kw["x"],
        kw["dt"],
        kw["A"],
        kw["B"],
        kw["C"],
        4,
        D=kw["D"],
        dt_bias=kw["dt_bias"],
        initial_states=kw["state"],
        dt_softplus=True,
        return_final_states=True,
    )
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_hf, rtol=1e-5, atol=1e-5)
    # HF's decode takes per-(head, channel) expanded A / dt / D, as the mamba_ssm kernel does.
    bsz, nh, p, n = h.shape
    hf_state = h.clone()
    y1_hf = hf.mamba2_selective_state_update(
        hf_state,
        kw["x"][:, 0],
        kw["dt"][:, 0, :, None].expand(-1, -1, p),
        kw["A"][:, None, None].expand(-1, p, n),
        kw["B"][:, 0],
        kw["C"][:, 0],
        kw["D"][:, None].expand(-1, p),
        dt_bias=kw["dt_bias"][:, None].expand(-1, p),
        dt_softplus=True,
    )
    y1, h1 = ssd_step(
        h,
        kw["x"][:, 0],
        kw["dt"][:, 0],
        kw["A"],
        kw["B"][:, 0],
        kw["C"][:, 0],
        D=kw["D"],
        dt_bias=kw["dt_bias"],
        dt_softplus=True,
    )
    torch.testing.assert_close(y1, y1_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1, hf_state, rtol=1e-5, atol=1e-5)


def test_matches_hf_mamba2_mixer():
    """Compose conv + SSD from the weights of a tiny HF Mamba2Mixer and compare its torch forward."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    cfg = Mamba2Config(
        hidden_size=8,
        state_size=4,
        num_heads=4,
        head_dim=4,
        expand=2,
        n_groups=2,
        conv_kernel=4,
        chunk_size=5,
        num_hidden_layers=1,
        time_step_limit=(0.0, 0.5),
    )
    m = Mamba2Mixer(cfg, layer_idx=0).eval()
    hs = torch.randn(2, 11, 8)
    with torch.no_grad():
        ref = m(hs)
        gate, xbc, dt = m.in_proj(hs).split([16, 16 + 2 * 2 * 4, 4], dim=-1)
        xbc, _ = causal_conv1d(xbc.transpose(1, 2), m.conv1d.weight[:, 0], m.conv1d.bias, activation="silu")
        xs, Bm, Cm = xbc.transpose(1, 2).split([16, 8, 8], dim=-1)
        y, _ = ssd_scan(
            xs.reshape(2, 11, 4, 4),
            dt,
            -torch.exp(m.A_log.float()),
            Bm.reshape(2, 11, 2, 4),
            Cm.reshape(2, 11, 2, 4),
            chunk_size=5,
            D=m.D,
            dt_bias=m.dt_bias,
            dt_softplus=True,
            dt_limit=(0.0, 0.5),
        )
        out = m.out_proj(m.norm(y.reshape(2, 11, 16), gate))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_heads_must_divide_groups():
    kw = make(5, nh=3, g=2)
    with pytest.raises(ValueError):
        scan(kw)


@pytest.mark.parametrize("group_bytes", [1, 2000])
def test_groups_of_chunks_carry_the_state_like_one_group(monkeypatch, group_bytes):
    """Long sequences run in memory-bounded groups of chunks (one chunk per group at group_bytes=1): each group
    hands its final state to the next, and the result is the naive recurrence's."""
    from hybridcache.ops import ssd

    kw = make(11, bsz=2, t=23, with_state=True)
    monkeypatch.setattr(ssd, "_GROUP_BYTES", group_bytes)
    y, h = scan(kw, chunk_size=4)
    ry, rh = oracle(kw)
    torch.testing.assert_close(y, ry, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, rh, rtol=1e-10, atol=1e-10)

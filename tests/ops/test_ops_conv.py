"""causal_conv1d / causal_conv1d_step vs a python-loop oracle and the HF torch path."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import causal_conv1d, causal_conv1d_step


def naive_conv(x, w, bias=None, state=None, activation=None):
    """y[t] = sum_k w[k] * seq[t + k], seq = concat(state, x); loops over time and taps."""
    bsz, c, t = x.shape
    k = w.shape[1]
    prefix = state if state is not None else torch.zeros(bsz, c, k - 1, dtype=x.dtype)
    seq = torch.cat([prefix, x], dim=-1)
    y = torch.zeros(bsz, c, t, dtype=x.dtype)
    for i in range(t):
        for j in range(k):
            y[:, :, i] += w[:, j] * seq[:, :, i + j]
    if bias is not None:
        y += bias[:, None]
    if activation == "silu":
        y = y * torch.sigmoid(y)
    return y, seq[:, :, seq.shape[-1] - (k - 1) :]


def _inputs(seed, bsz, c, t, k, with_bias, with_state, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, c, t, generator=g, dtype=dtype)
    w = torch.randn(c, k, generator=g, dtype=dtype)
    b = torch.randn(c, generator=g, dtype=dtype) if with_bias else None
    s = torch.randn(bsz, c, k - 1, generator=g, dtype=dtype) if with_state else None
    return x, w, b, s


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bsz=st.integers(1, 2),
    c=st.integers(1, 5),
    t=st.integers(0, 9),
    k=st.integers(1, 5),
    with_bias=st.booleans(),
    with_state=st.booleans(),
    activation=st.sampled_from([None, "silu"]),
)
def test_matches_naive(seed, bsz, c, t, k, with_bias, with_state, activation):
    x, w, b, s = _inputs(seed, bsz, c, t, k, with_bias, with_state)
    y, ns = causal_conv1d(x, w, b, state=s, activation=activation)
    ry, rs = naive_conv(x, w, b, s, activation)
    assert y.shape == (bsz, c, t) and ns.shape == (bsz, c, k - 1)
    torch.testing.assert_close(y, ry, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ns, rs, rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(0, 12),
    k=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 12), max_size=4),
    with_state=st.booleans(),
)
def test_random_splits_equal_one_call(seed, t, k, cuts, with_state):
    x, w, b, s = _inputs(seed, 2, 3, t, k, True, with_state)
    y_full, s_full = causal_conv1d(x, w, b, state=s, activation="silu")
    bounds = sorted({0, t, *[min(cut, t) for cut in cuts]})
    state, ys = s, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        y, state = causal_conv1d(x[..., lo:hi], w, b, state=state, activation="silu")
        ys.append(y)
    y_split = torch.cat(ys, -1) if ys else x.new_zeros(2, 3, 0)
    torch.testing.assert_close(y_split, y_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state if state is not None else s_full, s_full)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_steps_equal_scan_and_do_not_mutate(k):
    x, w, b, s = _inputs(7, 2, 4, 6, k, True, True)
    y_full, s_full = causal_conv1d(x, w, b, state=s, activation="silu")
    state = s
    for i in range(x.shape[-1]):
        before = state.clone()
        y, new = causal_conv1d_step(x[..., i], w, b, state, activation="silu")
        torch.testing.assert_close(state, before, rtol=0, atol=0)
        torch.testing.assert_close(y, y_full[..., i], rtol=1e-12, atol=1e-12)
        state = new
    torch.testing.assert_close(state, s_full, rtol=0, atol=0)
    assert s_full.shape == (2, 4, k - 1)


def test_short_sequence_state_and_no_aliasing():
    x, w, b, s = _inputs(8, 1, 3, 2, 4, False, True)  # T=2 < K-1=3
    _, ns = causal_conv1d(x, w, b, state=s)
    torch.testing.assert_close(ns, torch.cat([s[..., 2:], x], -1), rtol=0, atol=0)
    x2 = torch.randn(1, 3, 3, dtype=torch.float64)  # T == K-1: returned state must be a copy
    _, ns2 = causal_conv1d(x2, w, None)
    x2.zero_()
    assert ns2.abs().sum() > 0


def test_dtype_follows_x():
    x, w, b, s = _inputs(9, 2, 8, 5, 4, True, True, dtype=torch.float32)
    y, ns = causal_conv1d(x.bfloat16(), w, b, state=s, activation="silu")
    assert y.dtype == ns.dtype == torch.bfloat16
    ry, _ = causal_conv1d(x, w, b, state=s, activation="silu")
    torch.testing.assert_close(y.float(), ry, rtol=5e-2, atol=5e-2)
    y1, ns1 = causal_conv1d_step(x[..., 0].bfloat16(), w, b, s, activation="silu")
    assert y1.dtype == ns1.dtype == torch.bfloat16


def test_matches_hf_torch_path():
    from transformers.models.mamba import modeling_mamba as hf

    x, w, b, s = _inputs(10, 2, 6, 7, 4, True, False, dtype=torch.float32)
    y, ns = causal_conv1d(x, w, b, activation="silu")
    torch.testing.assert_close(y, hf.causal_conv1d_fn(x, w, b, activation="silu"))
    # HF decode keeps a width-K window; our state is its last K-1 columns.
    conv_state = F.pad(x, (4 - x.shape[-1], 0))[..., -4:].clone()
    xt = torch.randn(2, 6, 1)
    y_hf = hf.causal_conv1d_update(xt, conv_state, w, b, activation="silu")
    y1, ns1 = causal_conv1d_step(xt[..., 0], w, b, ns, activation="silu")
    torch.testing.assert_close(y1, y_hf[..., 0])
    torch.testing.assert_close(ns1, conv_state[..., 1:])


def test_bad_args():
    x, w, b, s = _inputs(11, 1, 2, 3, 3, False, False)
    with pytest.raises(ValueError):
        causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError):
        causal_conv1d(x, w, state=torch.zeros(1, 2, 5, dtype=x.dtype))

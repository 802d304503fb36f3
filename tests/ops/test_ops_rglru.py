"""linear_recurrence vs a python loop and HF RecurrentGemma's scan."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import linear_recurrence


def naive(a, x, state=None):
    bsz, t, w = x.shape
    h = [[float(state[b, j]) if state is not None else 0.0 for j in range(w)] for b in range(bsz)]
    out = torch.zeros(bsz, t, w, dtype=torch.float64)
    for i in range(t):
        for b in range(bsz):
            for j in range(w):
                h[b][j] = float(a[b, i, j]) * h[b][j] + float(x[b, i, j])
                out[b, i, j] = h[b][j]
    return out, torch.tensor(h, dtype=torch.float64).reshape(bsz, w)


def make(seed, bsz, t, w, dtype=torch.float64, with_state=True):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(bsz, t, w, generator=g, dtype=dtype)
    a[a < 0.1] = 0.0  # resets
    x = torch.randn(bsz, t, w, generator=g, dtype=dtype)
    s = torch.randn(bsz, w, generator=g, dtype=dtype) if with_state else None
    return a, x, s


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bsz=st.integers(1, 3),
    t=st.integers(0, 9),
    w=st.integers(1, 5),
    with_state=st.booleans(),
)
def test_matches_naive(seed, bsz, t, w, with_state):
    a, x, s = make(seed, bsz, t, w, with_state=with_state)
    h, last = linear_recurrence(a, x, s)
    rh, rlast = naive(a, x, s)
    assert h.shape == (bsz, t, w) and last.shape == (bsz, w)
    torch.testing.assert_close(h, rh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, rlast, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(0, 12), cuts=st.lists(st.integers(0, 12), max_size=4))
def test_random_splits_equal_one_call(seed, t, cuts):
    a, x, s = make(seed, 2, t, 3)
    h_full, last_full = linear_recurrence(a, x, s)
    bounds = sorted({0, t, *[min(c, t) for c in cuts]})
    state, hs = s, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        h, state = linear_recurrence(a[:, lo:hi], x[:, lo:hi], state)
        hs.append(h)
    if hs:
        torch.testing.assert_close(torch.cat(hs, 1), h_full, rtol=0, atol=0)
        torch.testing.assert_close(state, last_full, rtol=0, atol=0)


def test_dtypes_and_single_steps():
    a, x, s = make(1, 2, 6, 4, dtype=torch.float32)
    h, last = linear_recurrence(a.bfloat16(), x.bfloat16(), s)
    assert h.dtype == torch.bfloat16 and last.dtype == torch.float32
    h32, last32 = linear_recurrence(a, x, s)
    state = s
    for i in range(6):  # T=1 calls chain exactly like the full scan
        hi, state = linear_recurrence(a[:, i : i + 1], x[:, i : i + 1], state)
        torch.testing.assert_close(hi[:, 0], h32[:, i], rtol=0, atol=0)
    torch.testing.assert_close(state, last32, rtol=0, atol=0)
    _, same = linear_recurrence(a[:, :0], x[:, :0], s)  # T=0 returns the state (as a copy)
    torch.testing.assert_close(same, s)
    assert same.data_ptr() != s.data_ptr()


def test_matches_hf_recurrent_gemma_scan():
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    a, x, s = make(2, 2, 7, 5, dtype=torch.float32)
    no_reset = torch.zeros(2, 7, 1, dtype=torch.bool)
    h_hf, last_hf = RecurrentGemmaRglru._rnn_scan(None, x, a, no_reset, s)
    h, last = linear_recurrence(a, x, s)
    torch.testing.assert_close(h, h_hf)
    torch.testing.assert_close(last, last_hf)

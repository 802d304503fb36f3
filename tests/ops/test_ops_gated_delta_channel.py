"""Gated delta rule with a decay per key channel (Kimi Delta Attention): the chunked form and the one-token step vs
a naive per-token loop (float64), any chunking / split with a carried state, strong decays without overflow, the
per-head case as its special case, padding tokens as no-ops, and HF's KDA torch paths (float32)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import gated_delta_rule, gated_delta_step


def naive(q, k, v, g, beta, state=None, qk_l2norm=False):
    """Per token and head in float64: S <- diag(exp(g_t)) S; S <- S + b k (v - S^T k)^T; o = S^T q / sqrt(Dk)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    s = state.double().clone() if state is not None else torch.zeros(bsz, hv, dk, dv, dtype=torch.float64)
    o = torch.zeros(bsz, t, hv, dv, dtype=torch.float64)
    for b in range(bsz):
        for i in range(t):
            for h in range(hv):
                qv, kv = q[b, i, h // (hv // hk)], k[b, i, h // (hv // hk)]
                if qk_l2norm:
                    qv, kv = qv / torch.sqrt(qv @ qv + 1e-6), kv / torch.sqrt(kv @ kv + 1e-6)
                s[b, h] = torch.diag(torch.exp(g[b, i, h])) @ s[b, h]
                s[b, h] = s[b, h] + float(beta[b, i, h]) * torch.outer(kv, v[b, i, h] - s[b, h].T @ kv)
                o[b, i, h] = s[b, h].T @ qv * dk**-0.5
    return o, s


def make(seed, bsz=2, t=9, hk=2, ratio=1, dk=3, dv=4, dtype=torch.float64, strength=0.7):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    hv = hk * ratio
    return dict(
        q=r(bsz, t, hk, dk),
        k=r(bsz, t, hk, dk) * 0.6,
        v=r(bsz, t, hv, dv),
        g=-torch.nn.functional.softplus(r(bsz, t, hv, dk)) * strength,
        beta=torch.sigmoid(r(bsz, t, hv)),
        state=r(bsz, hv, dk, dv),
    )


TIME = ("q", "k", "v", "g", "beta")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(0, 11), chunk=st.integers(1, 6), ratio=st.integers(1, 2))
def test_chunked_matches_naive(seed, t, chunk, ratio):
    kw = make(seed, t=t, ratio=ratio)
    o, s = gated_delta_rule(**kw, chunk_size=chunk)
    o_ref, s_ref = naive(**kw)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), split=st.integers(0, 9))
def test_steps_and_splits_carry_the_state(seed, split):
    kw = make(seed, t=9)
    o_ref, s_ref = naive(**kw, qk_l2norm=True)
    o1, s = gated_delta_rule(**{n: (x[:, :split] if n in TIME else x) for n, x in kw.items()}, qk_l2norm=True)
    outs = [o1]
    for i in range(split, 9):  # the rest one token at a time
        o, s = gated_delta_step(s, *(kw[n][:, i] for n in ("q", "k", "v", "g", "beta")), qk_l2norm=True)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)


def test_strong_decay_stays_finite():
    """Cumulative log-decays of -2000 inside one chunk: exp(-c) alone would overflow even in float64."""
    kw = make(3, t=40, strength=100.0, dtype=torch.float32)
    o, s = gated_delta_rule(**kw, chunk_size=64)
    o_ref, s_ref = naive(**kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-4)


def test_uniform_channels_equal_the_per_head_decay():
    kw = make(5, t=10, ratio=2)
    per_head = kw["g"][..., 0]
    o1, s1 = gated_delta_rule(**{**kw, "g": per_head[..., None].expand_as(kw["g"])}, chunk_size=4)
    o2, s2 = gated_delta_rule(**{**kw, "g": per_head}, chunk_size=4)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=1e-12)


def test_padding_tokens_leave_the_state():
    kw = make(7, t=5)
    kw["g"][:, :2], kw["beta"][:, :2] = 0.0, 0.0  # two padding tokens first
    _, s = gated_delta_rule(**{n: (x[:, :2] if n in TIME else x) for n, x in kw.items()})
    assert torch.equal(s, kw["state"])


@pytest.mark.parametrize("t", [1, 7, 70])
def test_matches_hf_kda_torch_paths(t):
    kda = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    kw = make(11, bsz=2, t=t, hk=3, dk=8, dv=5, dtype=torch.float32, strength=2.0)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
    o, s = gated_delta_rule(*args, state=kw["state"], qk_l2norm=True)
    o_hf, s_hf = kda.chunk_kimi_delta_attention(
        *args, initial_state=kw["state"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)
    o_hf, s_hf = kda.recurrent_kimi_delta_attention(
        *args, initial_state=kw["state"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)

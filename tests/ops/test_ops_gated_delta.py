"""Gated delta rule: the chunked form and the one-token step vs a naive per-token, per-head loop (float64), random
splits with a carried state, padding tokens (beta = 0, g = 0) as no-ops, and HF's torch paths (float32)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import gated_delta_rule, gated_delta_step


def naive(q, k, v, g, beta, state=None, scale=None, qk_l2norm=False):
    """Python loops over time and value heads in float64, written as S_t = a_t (I - b_t k k^T) S_{t-1} + b_t k v^T."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    scale = dk**-0.5 if scale is None else scale
    s = state.double().clone() if state is not None else torch.zeros(bsz, hv, dk, dv, dtype=torch.float64)
    o = torch.zeros(bsz, t, hv, dv, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for b in range(bsz):
        for i in range(t):
            for h in range(hv):
                kh = h // (hv // hk)
                qv, kv = q[b, i, kh], k[b, i, kh]
                if qk_l2norm:
                    qv = qv / torch.sqrt((qv * qv).sum() + 1e-6)
                    kv = kv / torch.sqrt((kv * kv).sum() + 1e-6)
                a, w = float(torch.exp(g[b, i, h])), float(beta[b, i, h])
                s[b, h] = a * (eye - w * torch.outer(kv, kv)) @ s[b, h] + w * torch.outer(kv, v[b, i, h])
                o[b, i, h] = scale * (s[b, h].T @ qv)
    return o, s


def make(seed, bsz=2, t=9, hk=2, ratio=2, dk=3, dv=4, dtype=torch.float64, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    hv = hk * ratio
    return dict(
        q=r(bsz, t, hk, dk),
        k=r(bsz, t, hk, dk) * 0.6,
        v=r(bsz, t, hv, dv),
        g=-torch.nn.functional.softplus(r(bsz, t, hv)) * 0.7,
        beta=torch.sigmoid(r(bsz, t, hv)),
        state=r(bsz, hv, dk, dv) if with_state else None,
    )


TIME = ("q", "k", "v", "g", "beta")


def part(kw, lo, hi):
    return {n: (x[:, lo:hi] if n in TIME else x) for n, x in kw.items()}


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bsz=st.integers(1, 2),
    t=st.integers(0, 12),
    hk=st.integers(1, 2),
    ratio=st.integers(1, 3),
    dk=st.integers(1, 4),
    dv=st.integers(1, 3),
    chunk=st.sampled_from([1, 3, 5, 64]),
    with_state=st.booleans(),
    l2=st.booleans(),
)
def test_chunked_matches_naive(seed, bsz, t, hk, ratio, dk, dv, chunk, with_state, l2):
    kw = make(seed, bsz, t, hk, ratio, dk, dv, with_state=with_state)
    o, s = gated_delta_rule(**kw, chunk_size=chunk, qk_l2norm=l2)
    ro, rs = naive(**kw, qk_l2norm=l2)
    assert o.shape == (bsz, t, hk * ratio, dv) and s.shape == (bsz, hk * ratio, dk, dv)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, rs, rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(1, 13),
    cuts=st.lists(st.integers(0, 13), max_size=4),
    chunk=st.sampled_from([1, 2, 4, 64]),
    l2=st.booleans(),
)
def test_random_splits_and_steps_equal_one_call(seed, t, cuts, chunk, l2):
    """Blocks of random lengths, each from the state the previous one returned; length-1 blocks use the step."""
    kw = make(seed, t=t)
    o_full, s_full = naive(**kw, qk_l2norm=l2)
    bounds = sorted({0, t, *[min(c, t) for c in cuts]})
    state, outs = kw["state"], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        p = part(kw, lo, hi)
        if hi - lo == 1:
            before = state.clone()
            o, new = gated_delta_step(state, *(p[n][:, 0] for n in TIME), qk_l2norm=l2)
            torch.testing.assert_close(state, before, rtol=0, atol=0)  # the step never mutates its input
            o = o[:, None]
        else:
            o, new = gated_delta_rule(*(p[n] for n in TIME), chunk_size=chunk, state=state, qk_l2norm=l2)
        outs.append(o)
        state = new
    torch.testing.assert_close(torch.cat(outs, 1), o_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, s_full, rtol=1e-10, atol=1e-10)


def test_every_token_by_step_equals_naive():
    kw = make(3, t=7, hk=1, ratio=4)
    ro, rs = naive(**kw, scale=0.3)
    state = kw["state"]
    for i in range(7):
        o, state = gated_delta_step(state, *(kw[n][:, i] for n in TIME), scale=0.3)
        torch.testing.assert_close(o, ro[:, i], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, rs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_padding_tokens_leave_the_state_untouched(chunk):
    """Left padding as the models feed it: zero q/k/v, beta = 0 and g = 0 -> zero output, state unchanged."""
    kw = make(4, t=9)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, :5] = True
    padded = {n: (x.masked_fill(pad.view(2, 9, *[1] * (x.dim() - 2)), 0.0) if n in TIME else x) for n, x in kw.items()}
    o, s = gated_delta_rule(**padded, chunk_size=chunk, qk_l2norm=True)
    assert torch.equal(o[1, :5], torch.zeros_like(o[1, :5]))
    alone_o, alone_s = naive(*(kw[n][1:, 5:] for n in TIME), state=kw["state"][1:], qk_l2norm=True)
    torch.testing.assert_close(o[1:, 5:], alone_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s[1:], alone_s, rtol=1e-10, atol=1e-10)


def test_float32_inputs_and_bf16_outputs():
    kw = make(5, t=20, dtype=torch.float32)
    ro, rs = naive(**kw, qk_l2norm=True)
    for chunk in (1, 7, 64):
        o, s = gated_delta_rule(**kw, chunk_size=chunk, qk_l2norm=True)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.double(), rs, rtol=1e-5, atol=1e-5)
    half = {n: (x.bfloat16() if n in ("q", "k", "v") else x) for n, x in kw.items()}
    o, s = gated_delta_rule(**half, chunk_size=8, qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), ro, rtol=5e-2, atol=5e-2)


def test_matches_hf_torch_paths():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    kw = make(6, t=19, hk=2, ratio=2, dk=8, dv=4, dtype=torch.float32)
    args = (kw["q"], kw["k"], kw["v"])
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        *args,
        g=kw["g"],
        beta=kw["beta"],
        chunk_size=8,
        initial_state=kw["state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, s = gated_delta_rule(**kw, chunk_size=5, qk_l2norm=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)
    step = {n: kw[n][:, :1] for n in TIME}
    ref_o1, ref_s1 = hf.torch_recurrent_gated_delta_rule(
        step["q"],
        step["k"],
        step["v"],
        g=step["g"],
        beta=step["beta"],
        initial_state=s,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o1, s1 = gated_delta_step(s, *(step[n][:, 0] for n in TIME), qk_l2norm=True)
    torch.testing.assert_close(o1, ref_o1[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, ref_s1, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    kw = make(7, hk=2, ratio=1)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(
            kw["q"],
            kw["k"],
            kw["v"][:, :, :1].expand(-1, -1, 3, -1),
            kw["g"][..., :1].expand(-1, -1, 3),
            kw["beta"][..., :1].expand(-1, -1, 3),
        )
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule(**{**kw, "state": kw["state"][:, :1]})
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule(**kw, chunk_size=0)

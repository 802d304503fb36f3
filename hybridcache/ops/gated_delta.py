"""Gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) with an explicit initial / final state.

Per value head h (served by key head h // (Hv // Hk)), with a state S [Dk, Dv], a log-decay g_t <= 0 and a write
strength beta_t in [0, 1]:
    S   <- exp(g_t) * S                                         # forget (g_t per head, or per key channel: diag)
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T                 # delta rule: replace what S predicts for k_t
    o_t  = scale * S^T q_t                                      # [Dv]
with q, k optionally L2-normalised first and scale = Dk^-1/2 by default. `gated_delta_rule` runs the chunked
(WY / UT-transform) form for a block of tokens, `gated_delta_step` the recurrence for one token; both take the
state in and give the new state out, so a sequence can be fed in any split. Math runs in float32 (float64 for
float64 inputs or states); outputs come back in q.dtype, states in the accumulation dtype.

The decay is a scalar per head (g [.., Hv]: Gated DeltaNet) or one per key channel (g [.., Hv, Dk]: Kimi Delta
Attention, where the forget step scales row d of S by exp(g_t[d])). A token with beta = 0 and g = 0 leaves the
state exactly as it was (left padding uses that).
"""

from __future__ import annotations

import torch
from einops import rearrange

from ._dispatch import acc_dtype


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / HF convention: eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, state, scale, qk_l2norm):
    """Shared checks and casts: q, k repeated to the value heads, all in the accumulation dtype."""
    hk, hv = k.shape[-2], v.shape[-2]
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    acc = acc_dtype(q, k, v, state)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if hv != hk:  # key head i serves value heads i*r .. i*r + r-1
        q, k = q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return acc, q * scale, k, v, g, beta


def _initial(state, batch, hv, dk, dv, acc, device):
    if state is None:
        return torch.zeros(batch, hv, dk, dv, dtype=acc, device=device)
    if tuple(state.shape) != (batch, hv, dk, dv):
        raise ValueError(f"state must be [B, Hv, Dk, Dv] = {(batch, hv, dk, dv)}, got {tuple(state.shape)}")
    return state.to(acc)


def _decayed_dots(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """sum_d a_id b_jd exp(c_id - c_jd) for j <= i, 0 above the diagonal: a, b [..., L, Dk]; c [..., L, 1] (a decay
    per head) or [..., L, Dk] (per key channel: the [L, L, Dk] differences are formed, never exp(+c) alone, so a
    strong decay inside a chunk cannot overflow)."""
    n = c.shape[-2]
    lower = torch.ones(n, n, dtype=torch.bool, device=c.device).tril()
    if c.shape[-1] == 1:
        diff = c[..., :, None, 0] - c[..., None, :, 0]  # [..., L, L]
        return (a @ b.transpose(-1, -2)) * torch.exp(diff.masked_fill(~lower, float("-inf")))
    diff = c[..., :, None, :] - c[..., None, :, :]  # [..., L, L, Dk]
    decay = torch.exp(diff.masked_fill(~lower[..., None], float("-inf")))
    return ((a[..., :, None, :] * decay) * b[..., None, :, :]).sum(-1)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a block, in chunks.

    Args:
        q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv] (Hv a multiple of Hk); beta: [B, T, Hv]; g (log-decay, <= 0):
        [B, T, Hv] (per head) or [B, T, Hv, Dk] (per key channel);
        state: [B, Hv, Dk, Dv] before the block (None = zeros); chunk_size only affects speed and rounding.

    Returns:
        o [B, T, Hv, Dv] in q.dtype and the state [B, Hv, Dk, Dv] after the block (float32, or float64).

    Inside a chunk of L tokens with cumulative log-decay c_i and incoming state S0, the writes u_i =
    beta_i (v_i - S_{i-1}^T k_i) solve the unit lower-triangular system (I + A) u = beta (v - exp(c) K S0), with
    A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i; outputs and the outgoing state then follow in closed form. With a
    decay per key channel, exp(c) scales each channel of the key / query it multiplies.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    out_dtype = q.dtype
    batch, t, _, dk = k.shape
    hv, dv = v.shape[-2:]
    acc, q, k, v, g, beta = _prepare(q, k, v, g, beta, state, scale, qk_l2norm)
    s = _initial(state, batch, hv, dk, dv, acc, v.device)
    q, k, v = (rearrange(x, "b t h d -> b h t d") for x in (q, k, v))  # [B, Hv, T, D]
    g = rearrange(g, "b t h d -> b h t d") if g.dim() == 4 else rearrange(g, "b t h -> b h t 1")  # [B, Hv, T, Dk|1]
    beta = rearrange(beta, "b t h -> b h t")  # [B, Hv, T]
    outs = []
    for t0 in range(0, t, chunk_size):
        sl = slice(t0, t0 + chunk_size)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        c = torch.cumsum(g[:, :, sl], dim=-2)  # [B, H, L, Dk|1]
        system = torch.tril(bc[..., None] * _decayed_dots(kc, kc, c), diagonal=-1)  # A, strictly lower (unit diag)
        rhs = bc[..., None] * (vc - (kc * torch.exp(c)) @ s)  # [B, H, L, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, L, Dv]
        # o_i = (exp(c_i) q_i)^T S0 + sum_{j <= i} (q_i . exp(c_i - c_j) k_j) u_j
        o = (qc * torch.exp(c)) @ s + _decayed_dots(qc, kc, c) @ u
        # S_L = exp(c_L) S0 + sum_j (exp(c_L - c_j) k_j) u_j^T
        to_end = torch.exp(c[..., -1:, :] - c)  # [B, H, L, Dk|1]
        s = torch.exp(c[..., -1, :])[..., None] * s + (kc * to_end).transpose(-1, -2) @ u
        outs.append(o)
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(batch, hv, 0, dv)
    return rearrange(o, "b h t d -> b t h d").to(out_dtype), (s if t > 0 else s.clone())


def gated_delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (same math as `gated_delta_rule` with T=1); never modifies `state`.

    Args: state [B, Hv, Dk, Dv]; q, k [B, Hk, Dk]; v [B, Hv, Dv]; beta [B, Hv]; g [B, Hv] or [B, Hv, Dk].
    Returns: o [B, Hv, Dv] in q.dtype and a new state [B, Hv, Dk, Dv] (float32, or float64).
    """
    out_dtype = q.dtype
    batch, _, dk = k.shape
    hv, dv = v.shape[-2:]
    acc, q, k, v, g, beta = _prepare(q, k, v, g, beta, state, scale, qk_l2norm)
    forget = torch.exp(g)[..., None] if g.dim() == 3 else torch.exp(g)[..., None, None]  # [B, Hv, Dk|1, 1]
    s = _initial(state, batch, hv, dk, dv, acc, v.device) * forget
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)  # what the state recalls for k
    s = s + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - predicted))
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    return o.to(out_dtype), s

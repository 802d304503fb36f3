"""Masked (grouped-query) softmax attention, pure torch (a one-query block in float32 on CPU: one kernel call,
hybridcache/accel/native/kernels.py through the kernel seam ops/kernels.py, with the same guarantees; under
torch.compile
the op that runs it). `pattern_attention`: a one-query block whose visible keys the kernel evaluates from positions.

Robust to arbitrary masks: rows with no visible key return exact zeros, and
garbage (NaN/inf) stored in masked cache slots never reaches the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridcache.ops import kernels


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    return_weights: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an explicit boolean visibility mask.

    Args:
        q: [B, Hq, T, D] queries.
        k: [B, Hkv, S, D] keys; Hq must be a multiple of Hkv (query head h
            reads kv head h // (Hq // Hkv)).
        v: [B, Hkv, S, Dv] values.
        mask: bool [B, T, S], True = key visible to the query (shared by heads), or [B, Hkv, T, S] per kv head
            (patterns that keep different tokens per head).
        scale: multiplier applied to q @ k^T.
        softcap: if set, scores = softcap * tanh(scores / softcap).
        sinks: [Hq] learned per-head sink logits (GPT-OSS, GraniteSWA), or None: one extra logit per head in the
            softmax denominator that takes probability mass but adds no value (the weights then sum to < 1).
            The decode kernel and the explicit torch path take them (SDPA has no such column).

    Returns:
        [B, Hq, T, Dv] in q.dtype (and the attention weights [B, Hq, T, S] with `return_weights`). Scores,
        softmax and the weighted sum run in float32 (float64 if q is float64). Fully masked rows give zeros.

    Guarantees: a NaN/inf key in a masked slot only affects masked scores, which
    are replaced; values in slots that *no* query of the batch row can see are
    zeroed before the weighted sum (a NaN value visible to some query would
    otherwise leak into others through 0 * NaN in the matmul).
    """
    b, hq, t, dq = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    if mask.dim() not in (3, 4) or mask.shape[-2:] != (t, s) or (mask.dim() == 4 and mask.shape[1] != hkv):
        raise ValueError(f"mask {tuple(mask.shape)} does not match [B, {t}, {s}] or [B, {hkv}, {t}, {s}]")
    heads = mask.dim() == 4
    # a decode step: one kernel call (a mask of one row per batch row)
    if t == 1 and not return_weights and not heads and mask.shape[0] == b and decode_kernel(q, k, v, sinks):
        out = kernels.call("decode_attention", q, k, v, mask, None, None, "full", 0, scale, softcap, sinks)
        if out is not None:
            return out
    if (
        t > 1
        and not return_weights
        and sinks is None
        and softcap is None
        and q.dtype in (torch.float32, torch.float64)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and v.shape[-1] == dq
    ):
        out = _fused_attention(q, k, v, mask, scale)
        if out is not None:
            return out
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = hq // hkv

    # Group query heads by their kv head instead of repeating K/V: one matmul per kv head, few ops (a decode step
    # calls this once per attention layer, so every op counts).
    qg = q.to(acc).reshape(b, hkv, g * t, dq)  # [B, Hkv, G*T, D]
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)).view(b, hkv, g, t, s) * scale  # [B, Hkv, G, T, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    # masked_fill (not an additive mask): a NaN/inf score in a hidden slot is replaced, never added to
    mask5 = mask[:, :, None] if heads else mask[:, None, None]  # [B, Hkv or 1, 1, T, S]
    scores = scores.masked_fill(~mask5, float("-inf"))
    if sinks is not None:  # the sink column: in the softmax denominator, dropped before the weighted sum
        sink = sinks.to(acc).view(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]
    else:
        probs = torch.softmax(scores, dim=-1)
    empty = ~mask5.any(dim=-1, keepdim=True)  # queries that see nothing get zeros, not softmax's NaN
    probs = probs.masked_fill(empty, 0.0)

    seen = mask.any(dim=-2)[..., None] if heads else mask.any(dim=-2)[:, None, :, None]  # [B, Hkv or 1, S, 1]
    v_clean = torch.where(seen, v.to(acc), torch.zeros((), dtype=acc, device=v.device))
    out = torch.matmul(probs.view(b, hkv, g * t, s), v_clean)  # [B, Hkv, G*T, Dv]
    out = out.view(b, hq, t, out.shape[-1]).to(q.dtype)
    if return_weights:
        return out, probs.view(b, hq, t, s)
    return out


def decode_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> bool:
    """Whether one query per row [B, Hq, 1, D] attends by the decode kernel (eager: its wrapper; compiled: the
    hybridcache::decode_attention op): float32 keys and values of one shape, float32 sinks [Hq] or none."""
    return (
        kernels.takes(q)
        and k.dtype == torch.float32
        and v.dtype == torch.float32
        and k.shape == v.shape
        and (sinks is None or sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],))
    )


def pattern_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: tuple | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One query per row q [B, Hq, 1, D] over keys / values [B, Hkv, S, D] by the decode kernel, which evaluates
    which keys are visible from `pattern` (q positions [B, 1], key positions [B, S], kind, parameter: a cache view's
    `pattern()`) instead of a mask. None where the kernel does not take them: use masked_attention."""
    if q.shape[2] != 1 or pattern is None or not decode_kernel(q, k, v, sinks):
        return None
    qpos, kpos, kind, param = pattern
    if kpos.dim() != 2:  # per-head positions: by the mask
        return None
    return kernels.call("decode_attention", q, k, v, None, qpos, kpos, kind, param, scale, softcap, sinks)


def _fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """A prefill block through torch's fused `scaled_dot_product_attention` (2-3.5x faster on CPU than the explicit
    path: measured 6.2 -> 2.5 ms for 8 x 128 queries of 4 heads x 256 over 128 keys), keeping the guarantees: it
    would spread a NaN/inf from any slot to every query, so it is used only when keys and values are finite (their
    sums are: one reduction over K and V, cheap next to T x S scores), and queries that see nothing get zeros.
    None: not taken."""
    if not bool(torch.isfinite(k.sum() + v.sum())):  # NaN / inf anywhere (or sums past float range: also declined)
        return None
    heads = mask.dim() == 4  # per kv head: one mask row per query head
    attn_mask = mask.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if heads else mask[:, None]
    try:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    except TypeError:  # a torch without enable_gqa (< 2.5)
        return None
    empty = ~attn_mask.any(dim=-1, keepdim=True)  # [B, Hq or 1, T, 1]
    return out.masked_fill(empty, 0.0)

"""Masked (grouped-query) softmax attention, pure torch.

Robust to arbitrary masks: rows with no visible key return exact zeros, and
garbage (NaN/inf) stored in masked cache slots never reaches the output.
"""

from __future__ import annotations

import torch
from einops import rearrange


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an explicit boolean visibility mask.

    Args:
        q: [B, Hq, T, D] queries.
        k: [B, Hkv, S, D] keys; Hq must be a multiple of Hkv (query head h
            reads kv head h // (Hq // Hkv)).
        v: [B, Hkv, S, Dv] values.
        mask: bool [B, T, S], True = key visible to the query (shared by heads).
        scale: multiplier applied to q @ k^T.
        softcap: if set, scores = softcap * tanh(scores / softcap).

    Returns:
        [B, Hq, T, Dv] in q.dtype (and the attention weights [B, Hq, T, S] with `return_weights`). Scores, softmax and the weighted sum run in
        float32 (float64 if q is float64). Fully masked rows give zeros.

    Guarantees: a NaN/inf key in a masked slot only affects masked scores, which
    are replaced; values in slots that *no* query of the batch row can see are
    zeroed before the weighted sum (a NaN value visible to some query would
    otherwise leak into others through 0 * NaN in the matmul).
    """
    b, hq, t, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    if mask.dim() != 3 or mask.shape[-2:] != (t, s):
        raise ValueError(f"mask {tuple(mask.shape)} does not match [B, {t}, {s}]")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    # Group query heads by their kv head instead of repeating K/V.
    qg = rearrange(q.to(acc), "b (h g) t d -> b h g t d", h=hkv)  # [B, Hkv, G, T, D]
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k.to(acc)) * scale  # [B, Hkv, G, T, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)

    visible = mask[:, None, None]  # [B, 1, 1, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [B, Hkv, G, T, 1]; -inf on empty rows
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - row_max)  # exact 0 where masked
    denom = probs.sum(dim=-1, keepdim=True)
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))

    seen = mask.any(dim=-2)[:, None, :, None]  # [B, 1, S, 1] slot visible to some query
    v_clean = torch.where(seen, v.to(acc), torch.zeros((), dtype=acc, device=v.device))
    out = torch.einsum("bhgts,bhse->bhgte", probs, v_clean)  # [B, Hkv, G, T, Dv]
    out = rearrange(out, "b h g t e -> b (h g) t e").to(q.dtype)
    if return_weights:
        return out, rearrange(probs, "b h g t s -> b (h g) t s")
    return out

"""The oracle for re-typed attention patterns on any HF family: HF's own forward without a cache (the whole sequence
recomputed at every step), every attention layer masked with the pattern, written here from its definition (not
from hybridcache's specs). Positions exclude left padding, as HF's generate and hybridcache count them.

The mask goes in through a test-local attention function registered in HF's AttentionInterface, so HF still gets
its 2-D attention mask (recurrent layers zero their padding with it)."""

from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

ORACLE = "hc_test_pattern_oracle"
_PATTERN: dict = {}


def visible(pattern: dict, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The pattern's visibility for query / key positions (broadcasting, both >= 0)."""
    kind = pattern["type"]
    causal = k <= q
    if kind in ("full", "static"):
        return causal
    if kind == "sliding":
        return causal & (k > q - pattern["window"])
    if kind == "chunked":
        c = pattern["chunk_size"]
        return causal & (torch.div(k, c, rounding_mode="floor") == torch.div(q, c, rounding_mode="floor"))
    if kind == "sink":
        return causal & ((k < pattern["sinks"]) | (k > q - pattern["window"]))
    raise ValueError(kind)


def pattern_mask(pattern: dict, valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool over a whole sequence whose real tokens are `valid` [B, T]; padding rows / columns False."""
    pos = torch.where(valid.bool(), valid.long().cumsum(1) - 1, -1)
    q, k = pos[:, :, None], pos[:, None, :]
    return ((q >= 0) & (k >= 0) & visible(pattern, q, k))[:, None]


def _oracle_attention(module, query, key, value, attention_mask, **kwargs):
    mask = _PATTERN["mask"][..., -query.shape[2] :, :]  # (KV-sharing readers may keep only the last queries)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, additive, **kwargs)


if ORACLE not in ALL_ATTENTION_FUNCTIONS:
    AttentionInterface.register(ORACLE, _oracle_attention)


@torch.no_grad()
def oracle_generate(model, ids: torch.Tensor, mask: torch.Tensor, pattern: dict, new: int):
    """Greedy tokens and logits [B, new, V] of `model` recomputing the whole sequence each step under `pattern`."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ORACLE)
    try:
        seq, valid, logits = ids, mask, []
        for _ in range(new):
            _PATTERN["mask"] = pattern_mask(pattern, valid)
            pos = (valid.long().cumsum(1) - 1).clamp(min=0)
            out = model(input_ids=seq, attention_mask=valid, position_ids=pos, use_cache=False)
            step = out.logits[:, -1].float()
            logits.append(step)
            nxt = step.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            valid = torch.cat([valid, torch.ones_like(nxt)], 1)
        return seq, torch.stack(logits, 1)
    finally:
        model.set_attn_implementation(before)
        _PATTERN.clear()

"""The oracle of engine=hf: HF's own forward without a cache over the whole sequence, every attention layer masked
with its plan layer's pattern, written here from the pattern's definition (not from hybridcache's specs), so a cache
layer that keeps the wrong tokens differs from it. The mask goes in through an attention function registered in HF's
AttentionInterface that calls the modeling file's own eager attention (softcapping, sinks, scalings stay the
model's); HF still gets its 2-D attention mask, which its recurrent layers use."""

from __future__ import annotations

import sys

import torch

from experiments.core.errors import UserError

ORACLE = "hc_app_pattern_oracle"
_MASKS: dict[int, torch.Tensor] = {}  # decoder layer index -> [1, 1, T, T] bool, for the forward in progress
PATTERN_TYPES = ("full", "static", "sliding", "chunked", "sink")


def visible(pattern: dict, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Which key positions each query position sees (broadcasting), W visible tokens including the current one."""
    kind, causal = pattern["type"], k <= q
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


def patterns_of(plan) -> dict[int, dict]:
    """Each decoder layer's attention pattern in `plan` (recurrent layers need none). A type whose pattern this oracle
    does not know is a UserError naming it."""
    out: dict[int, dict] = {}
    for p in plan.layers:
        if p.kind != "attention" or p.member not in (None, "attention"):
            continue
        if p.type not in PATTERN_TYPES:
            raise UserError(
                f"engine=hf: no oracle for cache type '{p.type}' (layer {p.address}); it knows "
                f"{', '.join(PATTERN_TYPES)}"
            )
        out[p.index] = {
            "type": p.type,
            **{k: getattr(p.spec, k) for k in ("window", "chunk_size", "sinks") if getattr(p.spec, k, None)},
        }
    return out


def _attention(module, query, key, value, attention_mask, **kwargs):
    mask = _MASKS[module.layer_idx][..., -query.shape[2] :, : key.shape[2]]
    eager = sys.modules[type(module).__module__].eager_attention_forward
    additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
    return eager(module, query, key, value, additive.masked_fill_(~mask, torch.finfo(query.dtype).min), **kwargs)


@torch.no_grad()
def oracle_logits(model, prompt: list[int], tokens: list[int], patterns: dict[int, dict]) -> torch.Tensor:
    """The logits [N, V] that chose each of `tokens` after `prompt`, recomputed in one forward without a cache."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if ORACLE not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ORACLE, _attention)
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    pos = torch.arange(ids.shape[1], device=model.device)
    q, k = pos[:, None], pos[None, :]
    before = model.config._attn_implementation
    _MASKS.update({i: visible(p, q, k)[None, None] for i, p in patterns.items()})
    model.set_attn_implementation(ORACLE)
    try:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos[None], use_cache=False)
        return out.logits[0, len(prompt) - 1 :].float()
    finally:
        model.set_attn_implementation(before)
        _MASKS.clear()

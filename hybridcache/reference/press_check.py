"""Our score-based methods against kvpress on the same model, prompt and ratio: which positions each layer and kv
head kept, and the teacher-forced NLL of a continuation after the compressed prefill (kvpress's protocol: the
prompt in one forward, compressed at its end; the continuation in one forward at positions after the prompt).

    check = check_press(model, checkpoint_dir, context_ids, continuation_ids, "snapkv", 0.5)
    check.kept_agreement    # |ours ∩ kvpress| / |kvpress| over every compressed layer and head
    check.ours_nll, check.reference_nll
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybridcache.reference.kvpress_runner import KvpressResult, run_press

KVPRESS_CLASS = {
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
    "pyramidkv": "PyramidKVPress",
}
# kvpress 0.5.5 on transformers 5.2 scores pyramidkv's continuation only token by token (its layers' cache lengths
# differ and 5.2 sizes every layer's mask from layer 0); the NLL is the same quantity
FEED = {"pyramidkv": "per_token"}


@dataclass
class PressCheck:
    method: str
    compression_ratio: float
    reference: str  # e.g. "kvpress 0.5.5 SnapKVPress"
    ours_nll: float
    reference_nll: float | None
    max_token_nll_diff: float | None  # max over continuation tokens of |ours - kvpress|
    kept_agreement: float  # mean over compressed layers and kv heads of |ours ∩ kvpress| / |kvpress|
    layers_compared: int
    kept_tokens: int  # per head, summed over the compared layers (kvpress's count)
    reference_error: str | None = None
    reference_seconds: float = 0.0
    per_layer: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def continuation_nll(model, context: torch.Tensor, continuation: torch.Tensor, cache_config: dict) -> tuple:
    """Ours: the prompt as one block into a fresh cache, then the continuation as one block. Returns (NLL per
    continuation token [N], the cache)."""
    cache = model.make_cache(1, cache_config)
    with torch.no_grad():
        first = model(context, cache=cache)[:, -1:]  # predicts continuation token 0
        rest = model(continuation, cache=cache)[:, :-1]
    logits = torch.cat([first, rest], 1).float().log_softmax(-1)[0]  # [N, V]
    return -logits.gather(-1, continuation[0, :, None])[:, 0], cache


def kept_positions(cache) -> dict[int, torch.Tensor]:
    """Decoder layer -> [Hkv, S] positions its attention cache layer holds (batch row 0; -1 empty)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if layer.kind == "attention":
            pos = layer.key_positions()[0]
            out[i] = pos if pos.dim() == 2 else pos[None].expand(layer.spec.num_kv_heads, -1)
    return out


def agreement(ours: dict[int, torch.Tensor], theirs: dict[int, torch.Tensor]) -> dict[int, float]:
    """Per layer: the mean over kv heads of the share of kvpress's kept positions that we kept too."""
    per_layer = {}
    for layer, ref in theirs.items():
        mine = ours[layer]
        shares = [
            len(set(mine[h][mine[h] >= 0].tolist()) & set(ref[h].tolist())) / max(1, ref.shape[1])
            for h in range(ref.shape[0])
        ]
        per_layer[layer] = sum(shares) / len(shares)
    return per_layer


def check_press(
    model,
    checkpoint_dir,
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    method: str,
    compression_ratio: float,
    reference: KvpressResult | None = None,
    **press_kwargs: Any,
) -> PressCheck:
    """Run `method` at `compression_ratio` on every attention layer (mode: prefill, kvpress's semantics) in our
    cache and in kvpress (unless `reference` is given), and compare."""
    context = torch.tensor([list(context_ids)])
    continuation = torch.tensor([list(continuation_ids)])
    config = {"attention": {"type": method, "compression_ratio": compression_ratio, "mode": "prefill", **press_kwargs}}
    nll, cache = continuation_nll(model, context, continuation, config)
    if reference is None:
        reference = run_press(
            checkpoint_dir,
            context_ids,
            continuation_ids,
            press=method,
            compression_ratio=compression_ratio,
            feed=FEED.get(method, "one_forward"),
            **press_kwargs,
        )
    version = reference.meta.get("kvpress_version", "0.5.5")
    theirs = {i: k for i, k in reference.kept.items() if k.shape[1] < len(context_ids)}
    per_layer = agreement(kept_positions(cache), theirs)
    ref_nll = reference.nll
    return PressCheck(
        method=method,
        compression_ratio=compression_ratio,
        reference=f"kvpress {version} {KVPRESS_CLASS[method]}",
        ours_nll=float(nll.mean()),
        reference_nll=None if ref_nll is None else float(ref_nll.mean()),
        max_token_nll_diff=None if ref_nll is None else float((nll - ref_nll.to(nll.dtype)).abs().max()),
        kept_agreement=sum(per_layer.values()) / max(1, len(per_layer)),
        layers_compared=len(per_layer),
        kept_tokens=sum(int(k.shape[1]) for k in theirs.values()),
        reference_error=reference.error,
        reference_seconds=reference.wall_s,
        per_layer=per_layer,
    )

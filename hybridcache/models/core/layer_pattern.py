"""A config piece for attention-only families whose layers are full or sliding-window by a per-layer plan
(HF's `layer_types` and `sliding_window`; GraniteSWA, GPT-OSS): the plan's checks and each layer's native cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache import NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param

NATIVE_TYPE = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(kw_only=True)
class SlidingFullFields(AttentionFields):
    """`layer_types` None: the family's `default_layer_types()` (HF's default pattern)."""

    sliding_window: int | None = param(128, positive=True)
    layer_types: list[str] | None = param(None, choices=tuple(NATIVE_TYPE))

    def default_layer_types(self) -> list[str]:
        raise NotImplementedError

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.sliding_window is None and "sliding_attention" in self.layer_types:
            out.append("sliding_window is null but there are sliding_attention layers")
        return out

    def native_layers(self, dtype: torch.dtype) -> list[NativeLayer]:
        """`full` or `sliding` per layer; only the sliding layers get a window (a windowed cache type chosen for a
        full layer must not inherit it)."""
        attn = {"num_kv_heads": self.num_key_value_heads, "head_dim": self.attention_head_dim, "dtype": dtype}
        return [
            NativeLayer("sliding", {**attn, "window": self.sliding_window})
            if t == "sliding_attention"
            else NativeLayer("full", dict(attn))
            for t in self.layer_types
        ]

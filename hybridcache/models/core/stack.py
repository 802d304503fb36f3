"""The language-model skeleton: a typed config, a per-layer plan, one decoder layer per plan entry.

Most HF decoder LMs are `model.embed_tokens -> model.layers[i] -> model.<final norm> -> lm_head`. A family on
this skeleton says only what differs:

    @register_family("bamba")
    class BambaLM(StackLM):
        config_class = BambaConfig
        final_norm_name = "final_layernorm"                     # the checkpoint's name for the final norm

        def plan(self):                                         # one kind per decoder layer
            return ["attention" if i in attn else "mamba" for i in range(self.cfg.num_hidden_layers)]

        def shared(self):                                       # built once, handed to every layer (rotary)
            return RotaryEmbedding(...)

        def build_layer(self, kind, index, shared):
            return BambaDecoderLayer(self.cfg, kind, shared)

        def final_norm(self):
            return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

plus `native_layers()` (each plan entry's cache type). `self.cfg` is the typed config, `self.kinds` the plan.
Without an override, plan() is the config's `layer_types`, build_layer() is `layer_class(cfg, kind, shared)` and
final_norm() an RMSNorm with `final_norm_options`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import FamilyConfig
from hybridcache.nn.core.norms import RMSNorm


class DecoderStack(nn.Module):
    """HF's inner model: token embeddings, the decoder layers, and the final norm under the checkpoint's name."""

    def __init__(self, vocab: int, hidden: int, layers: Iterable[nn.Module], norm: nn.Module, norm_name: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.add_module(norm_name, norm)


class StackLM(HybridLM):
    """Base of the families built as embeddings -> planned decoder layers -> final norm -> untied/tied lm_head."""

    config_class: ClassVar[type[FamilyConfig]]
    final_norm_name: ClassVar[str] = "norm"
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    # -- what a family provides --------------------------------------------------------------------------------
    def plan(self) -> list[str]:
        """The kind of each decoder layer, in order (from `self.cfg`; default: its `layer_types`, as HF lists them)."""
        return list(self.cfg.layer_types)

    def shared(self) -> Any:
        """Modules every layer uses (a rotary embedding): built once, before the layers (default: none)."""
        return None

    layer_class: ClassVar[type[nn.Module]]  # what the default build_layer builds: layer_class(cfg, kind, shared)

    def build_layer(self, kind: str, index: int, shared: Any) -> nn.Module:
        return self.layer_class(self.cfg, kind, shared)

    final_norm_options: ClassVar[dict[str, bool]] = {}  # the default final norm's RMSNorm options (unit_offset...)

    def final_norm(self) -> nn.Module:
        """Default: RMSNorm(hidden_size, rms_norm_eps, **final_norm_options)."""
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, **self.final_norm_options)

    # -- the skeleton ------------------------------------------------------------------------------------------
    def __init__(self, config: Mapping[str, Any] | FamilyConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.kinds = self.plan()
        shared = self.shared()
        layers = [self.build_layer(kind, i, shared) for i, kind in enumerate(self.kinds)]
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, self.final_norm(), self.final_norm_name)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def types(self) -> list[str]:
        """The plan (the name several families used for it)."""
        return self.kinds

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(getattr(self.model, self.final_norm_name)(h))  # [B, T, V]

    def embed_head_parts(self) -> tuple | None:
        """(the embedding module, its multiplier 1.0, the final norm, lm_head) for a greedy C loop
        (accel/runs/embed_head.py), or None where a family computes its embedding or head its own way."""
        cls = type(self)
        if cls.embed is not HybridLM.embed or cls.head is not StackLM.head:
            return None
        return self.model.embed_tokens, 1.0, getattr(self.model, self.final_norm_name), self.lm_head

"""`HybridLM`: the base of every model family. Embeddings, decoder layers that each own one cache layer, head.

A family subclass builds its modules with the Hugging Face parameter names, declares each layer's native cache
type in `native_layers()`, and provides `embed`, `decoder_layers` and `head`. Positions and masks come from the
cache: `forward` never takes positions.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from hybridcache.blocks import StepInput
from hybridcache.cache import Cache, NativeLayer, get_layer_class


class HybridLM(nn.Module):
    """Base class: `model(input_ids, cache=..., attention_mask=...) -> logits [B, T, V]` advances the cache."""

    family: ClassVar[str] = "?"
    tied_weights: ClassVar[Mapping[str, str]] = {}  # our lm_head name -> the embedding it shares when tied

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)

    # -- what a family provides --------------------------------------------------------------------------------
    def native_layers(self) -> list[NativeLayer]:
        """Native cache type and shape parameters of every layer, in order."""
        raise NotImplementedError

    @property
    def decoder_layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hf_name(self, name: str) -> str:
        """Our state-dict name -> the checkpoint's name (the same unless a family renames)."""
        return name

    # -- shared ------------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def make_cache(
        self, batch_size: int = 1, cache_config: Mapping[str, Any] | None = None, max_length: int | None = None
    ) -> Cache:
        """This model's cache: native types unless `cache_config` overrides them; `max_length` preallocates."""
        return Cache.build(self.native_layers(), batch_size, cache_config, max_length, device=self.device)

    def check_cache(self, cache: Any, batch_size: int) -> None:
        """Raise (before anything changes) if `cache` was not built for this model and batch."""
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a hybridcache Cache (from model.make_cache), got {type(cache).__name__}")
        native = self.native_layers()
        if len(cache) != len(native):
            raise ValueError(f"the cache has {len(cache)} layers, this {self.family} model has {len(native)}")
        if cache.batch_size != batch_size:
            raise ValueError(f"the cache was built for batch size {cache.batch_size}, input_ids have {batch_size} rows")
        for i, (layer, nl) in enumerate(zip(cache, native)):
            kind = get_layer_class(nl.type).kind
            if layer.kind != kind:
                raise ValueError(f"cache layer {i} is a {layer.kind} cache, model layer {i} needs a {kind} cache")
            tunables = layer.spec.tunable_names()
            for key, value in nl.params.items():
                if key not in tunables and hasattr(layer.spec, key) and getattr(layer.spec, key) != value:
                    raise ValueError(
                        f"cache layer {i} has {key}={getattr(layer.spec, key)}, model layer {i} needs {key}={value}"
                    )

    def block_mask(self, attention_mask: Any, batch: int, tokens: int, cached: int) -> torch.Tensor:
        """The block's real-token mask [B, T] from a mask over the block or over the whole sequence."""
        if attention_mask is None:
            return torch.ones(batch, tokens, dtype=torch.bool, device=self.device)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 2-d tensor [B, T] of 0/1")
        if attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows, input_ids have {batch}")
        width = attention_mask.shape[1]
        if width == cached + tokens:
            attention_mask = attention_mask[:, cached:]
        elif width != tokens:
            raise ValueError(
                f"attention_mask has {width} columns; expected {tokens} (this block) or {cached + tokens} "
                f"(the {cached} cached tokens plus this block)"
            )
        return attention_mask.to(self.device).bool()

    def forward(
        self, input_ids: torch.Tensor, cache: Cache | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] for a block of tokens; advances `cache` (a fresh native cache when None)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a LongTensor [B, T]")
        batch, tokens = input_ids.shape
        if tokens == 0:
            raise ValueError("input_ids is empty (0 tokens)")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size:
            raise ValueError(f"input_ids hold ids outside the vocabulary [0, {self.vocab_size})")
        if cache is None:
            cache = self.make_cache(batch)
        self.check_cache(cache, batch)
        valid = self.block_mask(attention_mask, batch, tokens, cache.columns) if attention_mask is not None else None
        cache.positions(valid, tokens)  # validates left padding before anything changes
        return self.forward_block(input_ids.to(self.device), cache, valid)

    def forward_block(self, input_ids: torch.Tensor, cache: Cache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` without input validation (the compiled decode step): valid [B, T] bool or None (all real)."""
        all_real = valid is None
        if all_real:
            valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        step = StepInput(cache.positions(None if all_real else valid, input_ids.shape[1]), valid, all_real)
        h = self.embed(input_ids)
        for block, layer in zip(self.decoder_layers, cache):
            h = block(h, layer, step)
        return self.head(h)

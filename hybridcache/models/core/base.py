"""`HybridLM`: the base of every model family. Embeddings, decoder layers that each own a cache entry, head.

A family subclass builds its modules with the Hugging Face parameter names, declares per decoder layer its native
cache type in `native_layers()` (a `NativeLayer`, or a `NativeGroup` of named members for layers that hold several
caches, such as FalconH1's parallel Mamba2 + attention), and provides `embed`, `decoder_layers` and `head`. Decoder
layer i gets cache entry i (a cache layer or a `CacheGroup`). Positions and masks come from the cache: `forward`
never takes positions, and it validates everything before the first cache layer changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.cache import Cache, CacheError, CacheGroup, NativeGroup, get_layer_class
from hybridcache.cache.core.plan import Native
from hybridcache.cache.core.sequence import check_valid_mask


class GenerationError(ValueError):
    """A bad request to a model call, `generate`, `beam_search` or speculative decoding (arguments, token ids,
    masks, limits), raised before any work: no cache changed."""


class GenerationTypeError(GenerationError, TypeError):
    """An argument of the wrong kind (a `cache=` that is no Cache, a `prefix_cache=` that is no PrefixStore): still a
    TypeError for code that catches those."""


def check_input_ids(input_ids: Any, vocab_size: int) -> None:
    """input_ids: a LongTensor [B, T] with B, T >= 1, holding values (not on the meta device), ids in the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise GenerationError("input_ids must be a LongTensor [B, T]")
    if input_ids.is_meta:
        raise GenerationError("input_ids are on the meta device (shapes without values): pass real token ids")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise GenerationError(f"input_ids is empty (shape {tuple(input_ids.shape)}): give every row at least one token")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise GenerationError(f"input_ids hold ids outside the vocabulary [0, {vocab_size})")


def check_cached_columns(mask: torch.Tensor, cache: Any) -> None:
    """The mask [B, T >= cache.columns] marks as real, in the columns the cache holds, as many tokens per row as the
    cache saw (a whole-sequence mask passed with a cache that already holds its first columns)."""
    cached = cache.columns
    seen = mask[:, :cached].sum(1)
    if not torch.equal(seen, cache.seq.seen):
        row = int((seen != cache.seq.seen).nonzero()[0])
        raise GenerationError(
            f"attention_mask row {row} marks {int(seen[row])} of the {cached} cached columns as real, but the cache "
            f"saw {int(cache.seq.seen[row])} real tokens in that row"
        )


def check_mask_tensor(attention_mask: Any) -> None:
    """An attention mask must hold values: refuse one on the meta device (its .to() would fail inside torch)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_meta:
        raise GenerationError("attention_mask is on the meta device (shapes without values): pass a real 0/1 mask")


class HybridLM(nn.Module):
    """Base class: `model(input_ids, cache=..., attention_mask=...) -> logits [B, T, V]` advances the cache."""

    family: ClassVar[str] = "?"
    tied_weights: ClassVar[Mapping[str, str]] = {}  # our lm_head name -> the embedding it shares when tied
    fast_path = None  # the CPU fast path (hybridcache.accel.install, which from_pretrained calls): None, reference

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)

    # -- what a family provides --------------------------------------------------------------------------------
    def native_layers(self) -> list[Native]:
        """Per decoder layer, in order: its native cache type and shape parameters (or a group of them)."""
        raise NotImplementedError

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers in order (default: HF's usual `model.layers`)."""
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, D] (default: HF's usual `model.embed_tokens`)."""
        return self.model.embed_tokens(input_ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hf_name(self, name: str) -> str:
        """Our state-dict name -> the checkpoint's name (the same unless a family renames)."""
        return name

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors -> the tensors this model loads (folding multipliers, aliasing shared weights).

        Called by loading before names and shapes are matched; the default keeps the checkpoint as it is."""
        return state

    # -- shared ------------------------------------------------------------------------------------------------
    def fuse_projections(self) -> int:
        """Run q/k/v and gate/up projections as one matmul each (hybridcache/nn/core/linear_group.py);
        from_pretrained
        does this, and `model.to(...)` does it again for the converted parameters. Returns the groups fused."""
        from hybridcache.nn.core.linear_group import fuse_projections

        return fuse_projections(self)

    def _apply(self, fn, recurse=True):  # .to() / .float() / .cuda() replace the parameters: fuse the new ones
        out = super()._apply(fn, recurse)
        if getattr(self, "_projections_fused", False):
            self.fuse_projections()
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its float parameters'; packed projection weights do not count)."""
        packed = getattr(self, "_compute_dtype", None)
        return packed if packed is not None else next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def upcast_cpu_float32(self) -> bool:
        """Whether this model's sensitive mixers (Mamba2) compute in float64 on CPU for float32 weights."""
        return any(getattr(m, "upcast_cpu_float32", False) for m in self.modules() if m is not self)

    @upcast_cpu_float32.setter
    def upcast_cpu_float32(self, value: bool) -> None:
        for m in self.modules():
            if hasattr(m, "upcast_cpu_float32") and m is not self:
                m.upcast_cpu_float32 = bool(value)

    def make_cache(
        self, batch_size: int = 1, cache_config: Mapping[str, Any] | None = None, max_length: int | None = None
    ) -> Cache:
        """This model's cache: native types unless `cache_config` overrides them; `max_length` preallocates."""
        return Cache.build(self.native_layers(), batch_size, cache_config, max_length, device=self.device)

    def check_cache(self, cache: Any, batch_size: int) -> None:
        """Raise (before anything changes) if `cache` was not built for this model and batch."""
        if not isinstance(cache, Cache):
            raise GenerationTypeError(
                f"cache must be a hybridcache Cache (from model.make_cache), got {type(cache).__name__}"
            )
        native = self.native_layers()
        if len(cache) != len(native):
            raise GenerationError(
                f"the cache has {len(cache)} entries, this {self.family} model has {len(native)} layers"
            )
        if cache.batch_size != batch_size:
            raise GenerationError(
                f"the cache was built for batch size {cache.batch_size}, input_ids have {batch_size} rows"
            )
        for i, (entry, nl) in enumerate(zip(cache, native, strict=True)):
            if isinstance(nl, NativeGroup) != isinstance(entry, CacheGroup) or (
                isinstance(nl, NativeGroup) and list(nl.members) != list(entry)
            ):
                want = f"a group of {', '.join(nl.members)}" if isinstance(nl, NativeGroup) else "a single cache layer"
                raise GenerationError(f"cache entry {i} is {entry!r}, model layer {i} needs {want}")
            pairs = (
                [(f"{i}.{m}", entry[m], nl.members[m]) for m in nl.members]
                if isinstance(nl, NativeGroup)
                else [(str(i), entry, nl)]
            )
            for where, layer, member in pairs:
                kind = get_layer_class(member.type).kind
                if layer.kind != kind:
                    raise GenerationError(
                        f"cache layer {where} is a {layer.kind} cache, model layer {where} needs a {kind} cache"
                    )
                tunables = layer.spec.tunable_names()
                for key, value in member.params.items():
                    if key not in tunables and hasattr(layer.spec, key) and getattr(layer.spec, key) != value:
                        raise GenerationError(
                            f"cache layer {where} has {key}={getattr(layer.spec, key)}, model layer {where} needs "
                            f"{key}={value}"
                        )

    def block_mask(self, attention_mask: Any, batch: int, tokens: int, cache: Cache) -> torch.Tensor | None:
        """The block's real-token mask [B, T] (None: all real) from a 0/1 mask over the block or over the whole
        sequence (the cache's columns plus this block; its cached part must match what the cache saw)."""
        if attention_mask is None:
            return None
        check_mask_tensor(attention_mask)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise GenerationError("attention_mask must be a 2-d tensor [B, T] of 0/1 (or bool)")
        if attention_mask.shape[0] != batch:
            raise GenerationError(f"attention_mask has {attention_mask.shape[0]} rows, input_ids have {batch}")
        cached, width = cache.columns, attention_mask.shape[1]
        if width not in (tokens, cached + tokens):
            raise GenerationError(
                f"attention_mask has {width} columns; expected {tokens} (this block) or {cached + tokens} "
                f"(the {cached} cached columns plus this block)"
            )
        zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
        mask = check_mask(attention_mask.to(self.device), zeros, width)
        if width != tokens and cached:
            check_cached_columns(mask, cache)
            mask = mask[:, cached:]
        return mask

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        allow_padding_rows: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, V] for a block of tokens; advances `cache` (a fresh native cache when None).

        Everything is validated before the first cache layer changes, and a forward that fails anyway (an
        interrupt, a bug) drops the block: the cache is left as it was. A row whose block is all padding while the
        cache holds nothing for it gets meaningless logits, so it is refused unless `allow_padding_rows` (the
        first pieces of a long left-padded prompt prefilled in chunks).
        """
        check_input_ids(input_ids, self.vocab_size)
        batch, tokens = input_ids.shape
        if cache is None:
            cache = self.make_cache(batch)
        self.check_cache(cache, batch)
        valid = self.block_mask(attention_mask, batch, tokens, cache)
        if valid is not None and not allow_padding_rows:
            empty = ~valid.any(1) & (cache.seq.seen == 0)
            if bool(empty.any()):
                raise GenerationError(
                    f"row {int(empty.nonzero()[0])} of this block is all padding and the cache holds no real token "
                    "for it, so its logits would be meaningless (pass allow_padding_rows=True when prefilling a "
                    "left-padded prompt in pieces)"
                )
        return self.feed_block(input_ids.to(self.device), cache, valid)

    def feed_block(
        self,
        input_ids: torch.Tensor,
        cache: Cache,
        valid: torch.Tensor | None = None,
        step: Callable[..., torch.Tensor] | None = None,
        check: bool = True,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Feed one block as a cache transaction: open it (validating the mask and every layer's capacity), run
        `step` (default `forward_block`; the compiled decode step in generation), commit, or drop it on failure.
        `last_only` computes the head for the block's last position only ([B, 1, V]): what prefill needs, and on a
        tied 262k-token head it is most of a prefill's time."""
        cache.begin_block(valid, input_ids.shape[1], check=check, ids=input_ids)
        try:
            if step is None:
                logits = self.forward_block(input_ids, cache, last_only=last_only)
            else:
                logits = step(input_ids, cache)
        except BaseException:
            cache.abort_block()
            raise
        cache.end_block()
        if cache.owner is None or cache.owner() is not self:  # the model that fed it: whose identity `save` records
            cache.owner = weakref.ref(self)
        return logits

    def forward_block(self, input_ids: torch.Tensor, cache: Cache, last_only: bool = False) -> torch.Tensor:
        """The model body for the cache's open block (no validation; what the compiled decode step runs)."""
        step = cache.current_block
        h = self.embed(input_ids)
        h = self.layers_forward(h, cache.entries, step)
        return self.head(h[:, -1:] if last_only else h)

    def layers_forward(self, h: torch.Tensor, entries, step, blocks=None) -> torch.Tensor:
        """h [B, T, D] through the decoder layers (`blocks`, default all) with their cache entries: by the fast
        path's few C calls where installed and it takes the step (an eager decode step), else one call per layer."""
        blocks = self.decoder_layers if blocks is None else blocks
        fast = self.fast_path
        if fast is not None:
            out = fast.layers(blocks, entries, h, step)
            if out is not None:
                return out
        for block, entry in zip(blocks, entries, strict=True):
            h = block(h, entry, step)
        return h


def check_mask(mask: torch.Tensor, seen: torch.Tensor, width: int) -> torch.Tensor:
    """A 0/1 (or bool) left-padding mask as bool; anything else is a named ValueError."""
    try:
        return check_valid_mask(mask, mask.shape[0], width, seen, "attention_mask")
    except CacheError as e:
        raise GenerationError(str(e)) from None

"""Specs of the attention cache types and their visibility patterns.

W counts the visible tokens including the current one (HF masking_utils, flash-attn (W-1, 0), MLX):
    full        kv <= q
    sliding(W)  q - W < kv <= q
    chunked(C)  kv // C == q // C  and  kv <= q
Positions are absolute token positions of a row, left padding excluded.

A spec also says how a preallocated (static) layout places positions into slots: a linear buffer (`full`), a ring
(`sliding`, `chunked`), or anything compact a pattern needs (attention sinks: fixed slots, then a ring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.cache.core.base import LayerSpec, check_positive_int, dtype_nbytes, tunable
from hybridcache.cache.core.errors import CacheConfigError, CacheError
from hybridcache.cache.storage.codecs import KVCodec, codec_class, get_codec


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(LayerSpec):
    """Keys and values of `num_kv_heads` heads of size `head_dim`.

    `max_length` preallocates static storage for that many tokens per row; `storage` names the codec that stores
    each kept token (`dense`, or e.g. `int8`, `int4`, `offload`; see kv_codecs.py), `q_group_size` its quantization
    group along head_dim (None: the format's default); `residual` keeps the most recent tokens of a quantized
    storage unquantized as well (see residual_window.py). Layer-level storages (`kivi`, `hf_quantized`: KIVI and HF's
    QuantizedCache exactly, grouped_codecs.py) take `nbits`, `q_group_size`, `residual` (their own dense tail) and,
    for hf_quantized, `axis_key` / `axis_value`.
    """

    num_kv_heads: int
    head_dim: int
    max_length: int | None = tunable(None)
    storage: str = tunable("dense")
    q_group_size: int | None = tunable(None)
    residual: int | None = tunable(None)
    nbits: int | None = tunable(None)
    axis_key: int | None = tunable(None)
    axis_value: int | None = tunable(None)
    # whether `visible` is still the form the built-in `kernel_pattern` declares: a spec class that defines its own
    # `visible` without declaring its `kernel_pattern` loses the form it inherited (the kernels read a mask)
    inherited_form_holds: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "visible" in vars(cls) and "kernel_pattern" not in vars(cls):
            cls.inherited_form_holds = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_positive_int(owner, "num_kv_heads", self.num_kv_heads)
        check_positive_int(owner, "head_dim", self.head_dim)
        check_positive_int(owner, "max_length", self.max_length, allow_none=True)
        if not isinstance(self.storage, str):
            raise CacheError(f"{owner}: storage must be the name of a storage format, got {self.storage!r}")
        check_positive_int(owner, "q_group_size", self.q_group_size, allow_none=True)
        r = self.residual
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise CacheError(
                f"{owner}: residual must be a non-negative integer (recent tokens kept unquantized), got {r!r}"
            )
        codec = self.codec()  # unknown names, options and group sizes fail here, with what is known
        if getattr(codec, "grouped", False) and self.max_length is not None:
            raise CacheConfigError(
                f"{owner}: storage '{self.storage}' keeps column-aligned dynamic storage for the "
                "whole batch; it does not support max_length (preallocation)"
            )
        if getattr(codec, "grouped", False) and self.per_head:
            raise CacheConfigError(
                f"{owner}: storage '{self.storage}' quantizes columns of the whole batch together: "
                "it cannot follow an eviction that keeps different tokens per row or head"
            )
        if r and self.per_head:
            raise CacheError(
                f"{owner}: residual={r} is not available for a pattern that keeps different tokens per "
                "kv head (the residual window holds one position per row and slot)"
            )
        if r and codec.exact:
            raise CacheError(
                f"{owner}: residual={r} keeps the most recent tokens unquantized, but storage "
                f"'{self.storage}' is exact already; use it with a quantized storage (int8, int4)"
            )
        dense = self.num_kv_heads * self.head_dim * dtype_nbytes(self.dtype)
        object.__setattr__(
            self, "_nbytes", (2 * self.num_kv_heads * codec.token_nbytes(self.head_dim, self.dtype), 2 * dense)
        )

    def codec(self) -> KVCodec:
        """A codec of this spec's storage format (validated against head_dim and dtype)."""
        options = dict(
            q_group_size=self.q_group_size, nbits=self.nbits, axis_key=self.axis_key, axis_value=self.axis_value
        )
        if getattr(codec_class(self.storage), "grouped", False):  # `residual` is the storage's own dense tail
            options["residual"] = self.residual
        codec = get_codec(self.storage, **options)
        codec.check(self.head_dim, self.dtype)
        return codec

    # -- the pattern -------------------------------------------------------------------------------------------
    @property
    def per_head(self) -> bool:
        """Whether each kv head keeps its own tokens (positions [B, H, S]) rather than one set per row ([B, S])."""
        return False

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """May a query at position q see a key at position kv? (broadcasting; both >= 0)"""
        return kv <= q

    def needed_tokens(self, seen: torch.Tensor | int) -> torch.Tensor | int:
        """How many earlier tokens the next query (at position `seen`) can see: what must stay held."""
        return seen

    @property
    def rollback(self) -> int:
        """Tokens a crop may take back exactly: what `keeps` holds beyond `visible` (the pattern specs' `spare`)."""
        return 0

    def keeps(self, seen: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Which held positions `kv` stay held once a row has seen `seen` tokens: those its next query sees, and with
        `rollback` r > 0 also those the queries at the r positions before it see, so that a crop of up to r tokens
        finds every token it needs (speculative decoding's rollback by crop)."""
        keep = self.visible(seen, kv)
        for back in range(1, self.rollback + 1):
            keep = keep | self.visible((seen - back).clamp(min=0), kv)
        return keep

    def held_tokens(self, seen: int) -> int:
        """How many tokens `keeps` holds after `seen` tokens: what the query `rollback` positions back needs, plus
        the tokens since (a sliding window's W - 1 + r; a chunk's start through the query)."""
        r = min(self.rollback, seen)
        return int(self.needed_tokens(seen - r)) + r if r else int(self.needed_tokens(seen))

    def kernel_pattern(self) -> tuple[str, int] | None:
        """The form of `visible` that the decode kernels evaluate from positions themselves: ("full", 0),
        ("sliding", window) or ("chunked", chunk size) (accel/native/op_declarations.PATTERNS), or None (they read a
        mask: slower,
        the same numbers). A pattern of one of those forms says so here and gets the fast paths (the attention
        kernel by positions, the one-call attention that writes the cache's slot); what it declares must equal its
        `visible` (tests/models/test_kernel_pattern.py checks the built-in and a plugin one). The built-in specs
        declare theirs only while `visible` is their own: a subclass that changes it declares its own form."""
        return ("full", 0) if self.inherited_form_holds else None

    @property
    def ring_size(self) -> int | None:
        """Slots of a preallocated ring buffer (None: a linear buffer of max_length slots)."""
        return None

    # -- the static layout (used when max_length is set) -------------------------------------------------------
    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        """The slot that holds position `pos` (>= 0) in preallocated storage."""
        ring = self.ring_size
        return pos if ring is None else pos % ring

    def stays_in_slots(self, pos: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Which positions of a block to write into preallocated storage once a row has seen `seen` tokens.

        Everything the pattern still needs, plus spare tokens for `crop`; the kept positions must map to
        distinct slots. Default: the last `slots` positions.
        """
        return (pos >= 0) & (pos >= seen - self.slots)

    # -- memory ------------------------------------------------------------------------------------------------
    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's key and value, as the storage format keeps them."""
        return self._nbytes[0]

    @property
    def dense_token_nbytes(self) -> int:
        """Bytes of one token's key and value unquantized (in `dtype`): what a residual-window token adds."""
        return self._nbytes[1]

    @property
    def slots(self) -> int | None:
        """Preallocated slots per row (None when storage is dynamic)."""
        if self.max_length is None:
            return None
        return self.max_length if self.ring_size is None else min(self.ring_size, self.max_length)

    @property
    def residual_slots(self) -> int | None:
        """Preallocated slots of the residual window's ring per row: min(residual, slots) (None when dynamic)."""
        return None if self.slots is None else min(self.residual or 0, self.slots)

    def min_nbytes(self, batch: int, tokens: int) -> int:
        """Every needed token in `storage`; the last `residual` of them also unquantized."""
        codec = self.codec()
        if getattr(codec, "grouped", False):  # the storage's own flush and eviction rules (grouped_codecs.py)
            return batch * codec.row_nbytes(self, tokens)
        needed = self.held_tokens(tokens)
        return batch * (needed * self.token_nbytes + min(needed, self.residual or 0) * self.dense_token_nbytes)

    def max_nbytes(self, batch: int, tokens: int) -> int:
        """The most this layer may hold in that situation, whatever the split of the blocks (min_nbytes unless the
        storage's bytes depend on the split: hf_quantized's dense buffer)."""
        codec = self.codec()
        if getattr(codec, "grouped", False):
            return batch * codec.row_max_nbytes(self, tokens)
        return self.min_nbytes(batch, tokens)

    def held_nbytes(self, batch: int, tokens: int) -> int:
        if self.slots is not None:
            return batch * (self.slots * self.token_nbytes + self.residual_slots * self.dense_token_nbytes)
        return self.min_nbytes(batch, tokens)


@dataclass(frozen=True, kw_only=True)
class FullSpec(AttentionSpec):
    """Every earlier token stays visible."""


MAX_SPARE = 1024  # eviction evaluates the pattern once per spare position


def check_spare(spec: AttentionSpec) -> None:
    """`spare`: a non-negative int, for dynamic dense or per-token-quantized storage (a preallocated ring, a residual
    window or a layer-level storage has its own slots: refused)."""
    name = type(spec).__name__
    if isinstance(spec.spare, bool) or not isinstance(spec.spare, int) or not 0 <= spec.spare <= MAX_SPARE:
        raise CacheError(f"{name}: spare must be an integer in [0, {MAX_SPARE}], got {spec.spare!r}")
    if spec.spare and (spec.max_length is not None or spec.residual or spec.storage in ("kivi", "hf_quantized")):
        raise CacheError(
            f"{name}: spare={spec.spare} keeps extra tokens in dynamic storage; it does not combine with max_length, "
            "residual or a layer-level storage (kivi, hf_quantized)"
        )


@dataclass(frozen=True, kw_only=True)
class SlidingSpec(AttentionSpec):
    """The last `window` tokens are visible, the current one included. `spare` r keeps the tokens the last r earlier
    queries saw too, so a crop of up to r tokens stays exact (what speculative decoding's rollback needs)."""

    window: int = tunable()
    spare: int = tunable(0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "window", self.window)
        check_spare(self)

    @property
    def rollback(self) -> int:
        return self.spare

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (kv > q - self.window)

    def kernel_pattern(self) -> tuple[str, int] | None:
        return ("sliding", self.window) if self.inherited_form_holds else None

    def needed_tokens(self, seen):
        return seen.clamp(max=self.window - 1) if isinstance(seen, torch.Tensor) else min(seen, self.window - 1)

    @property
    def ring_size(self) -> int:
        return self.window  # W-1 held tokens plus the slot the decode token is written into


@dataclass(frozen=True, kw_only=True)
class ChunkedSpec(AttentionSpec):
    """Tokens see the earlier tokens of their own chunk of `chunk_size` positions (`spare`: as SlidingSpec's)."""

    chunk_size: int = tunable()
    spare: int = tunable(0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "chunk_size", self.chunk_size)
        check_spare(self)

    @property
    def rollback(self) -> int:
        return self.spare

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (torch.div(kv, self.chunk_size, rounding_mode="floor") == q // self.chunk_size)

    def kernel_pattern(self) -> tuple[str, int] | None:
        return ("chunked", self.chunk_size) if self.inherited_form_holds else None

    def needed_tokens(self, seen):
        return seen % self.chunk_size

    @property
    def ring_size(self) -> int:
        return self.chunk_size

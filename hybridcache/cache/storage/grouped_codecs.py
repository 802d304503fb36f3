"""`storage: kivi` and `storage: hf_quantized`: layer-level storages (grouped_kv.py) selectable like any codec.

A per-token codec (kv_codecs.py) encodes each kept token on its own; these formats quantize tokens together and own
the layer's keys and values as a whole (`GroupedKVStorage`), so the attention layer hands them its blocks instead
(cache/attention/storage/grouped.py). Registered as codecs with `grouped = True`: the name, the options a spec
passes, the checks, and the byte formulas live here; a codec of this kind stores no per-slot parts (`fields` is
empty).

Where they apply: dynamic storage (no `max_length`: their state is column-aligned, not slot-addressed) of patterns
whose eviction is the pattern's own (full, sliding, chunked, sink); score-based methods evict per row (and head),
which a storage that quantizes columns of the whole batch together cannot follow, so those are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hybridcache.cache.core.base import dtype_nbytes
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.storage.codecs import KVCodec, register_kv_codec
from hybridcache.cache.storage.grouped import GroupedKVStorage
from hybridcache.cache.storage.hf_quantized import HFQuantizedStorage
from hybridcache.cache.storage.kivi import KiviStorage


def first_needed(spec: Any, tokens: int) -> int:
    """The first position (= column, no padding) the next query of a row that has seen `tokens` can see; `tokens`
    when it sees none of them (a chunk boundary)."""
    if tokens == 0:
        return 0
    seen = spec.visible(torch.tensor(tokens), torch.arange(tokens))
    return int(seen.to(torch.uint8).argmax()) if bool(seen.any()) else tokens


class GroupedCodec(KVCodec):
    """A layer-level storage format; `options` are spec fields (`residual` is the storage's dense tail)."""

    grouped: ClassVar[bool] = True
    preallocates: ClassVar[bool] = False
    kit_params: ClassVar[dict[str, Any]] = {}  # what the conformance kit tries it with (head_dim 8)

    def __init__(self, **options: Any) -> None:
        self.config = options

    def fields(self, head_dim: int, dtype: torch.dtype):  # no per-slot parts: the storage holds everything
        return {}

    def encode(self, x: torch.Tensor):
        raise CacheConfigError(f"storage '{self.name}' is layer-level: feed it blocks through its layer")

    def decode(self, parts, dtype):
        raise CacheConfigError(f"storage '{self.name}' is layer-level: read it through its layer")

    def check(self, head_dim: int, dtype: torch.dtype) -> None:
        self.storage(1, 1, head_dim, dtype, "meta")  # the storage's own validation (CacheConfigError)

    def storage(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: Any) -> GroupedKVStorage:
        raise NotImplementedError

    def row_nbytes(self, spec: Any, tokens: int) -> int:
        """Bytes one unpadded row holds after `tokens` tokens (the storage's flush and eviction rules)."""
        raise NotImplementedError

    def row_max_nbytes(self, spec: Any, tokens: int) -> int:
        """The most one row may hold after `tokens` tokens, whatever the split (= row_nbytes where split-free)."""
        return self.row_nbytes(spec, tokens)


@register_kv_codec("kivi")
class KiviCodec(GroupedCodec):
    """KIVI-`nbits` (2 or 4; default 2), keys per channel in groups of `q_group_size` tokens (default 32), values per
    token in groups of `q_group_size` elements, the last `residual` tokens (default 128, a multiple of the group)
    in full precision: the authors' defaults (kivi_storage.py)."""

    options = ("nbits", "q_group_size", "residual")
    kit_params = {"q_group_size": 4, "residual": 8}
    # max |attention output error| on the kit's unit-normal float64 data (head_dim 8, G 4, R 8, <= 30 tokens, every
    # pattern, seeds 0-2; measured: 2 bits 0.49, 4 bits 0.11), with a 2x margin. 2-bit codes have 4 levels: an
    # element moves by up to its group's range / 6, so outputs can move by a good part of |v|; a regression guard on
    # this data, not a quality claim (the real-model NLL is: tests/reference/test_hf_quantized_live.py, README).
    bounds = {2: 1.0, 4: 0.25}

    def __init__(self, nbits: int = 2, q_group_size: int = 32, residual: int = 128) -> None:
        super().__init__(nbits=nbits, q_group_size=q_group_size, residual=residual)
        self.output_error_bound = self.bounds.get(nbits)

    def storage(self, batch, heads, head_dim, dtype, device):
        c = self.config
        return KiviStorage(
            batch,
            heads,
            head_dim,
            dtype,
            device,
            bits=c["nbits"],
            group_size=c["q_group_size"],
            residual_length=c["residual"],
        )

    def row_nbytes(self, spec, tokens):
        b, g, r = self.config["nbits"], self.config["q_group_size"], self.config["residual"]
        d, es, cut = spec.head_dim, dtype_nbytes(spec.dtype), first_needed(spec, tokens)
        codes = d * b // 8
        k_quant = tokens // r * r  # keys: columns < floor(seen / R) * R quantized; whole groups before `cut` dropped
        k_held = max(0, k_quant - cut // g * g)
        keys = k_held * codes + k_held // g * 2 * d * es + (tokens - k_quant) * d * es
        v_held = max(0, max(0, tokens - r) - cut)  # values: columns < seen - R quantized, dropped one by one
        values = v_held * (codes + 2 * (d // g) * es) + min(tokens, r) * d * es
        return spec.num_kv_heads * (keys + values)


@register_kv_codec("hf_quantized")
class HFQuantizedCodec(GroupedCodec):
    """HF transformers 5.2's QuantizedCache(quanto): `nbits` 2 or 4 (default 4), `axis_key` / `axis_value` 0 or -1
    (default 0), `q_group_size` (default 64), `residual` (default 128): HF's defaults (hf_quantized_storage.py)."""

    options = ("nbits", "axis_key", "axis_value", "q_group_size", "residual")
    kit_params = {"q_group_size": 8, "residual": 4}
    # as for KIVI (kit data, G 8, R 4; measured: 4 bits 0.14, 2 bits 0.82; 2x margin). HF re-quantizes what it
    # holds at each flush, so errors compound with the number of flushes
    bounds = {2: 1.6, 4: 0.3}

    def __init__(
        self, nbits: int = 4, axis_key: int = 0, axis_value: int = 0, q_group_size: int = 64, residual: int = 128
    ) -> None:
        super().__init__(
            nbits=nbits, axis_key=axis_key, axis_value=axis_value, q_group_size=q_group_size, residual=residual
        )
        self.output_error_bound = self.bounds.get(nbits)

    def storage(self, batch, heads, head_dim, dtype, device):
        c = self.config
        return HFQuantizedStorage(
            batch,
            heads,
            head_dim,
            dtype,
            device,
            nbits=c["nbits"],
            axis_key=c["axis_key"],
            axis_value=c["axis_value"],
            q_group_size=c["q_group_size"],
            residual_length=c["residual"],
        )

    def _token_nbytes(self, spec) -> tuple[int, int]:
        """(quantized, dense) bytes of one token's key and value over the row's heads: codes + a scale and a minimum
        per q_group_size elements (quanto's groups, axis 0 or -1 alike)."""
        d, es, h = spec.head_dim, dtype_nbytes(spec.dtype), spec.num_kv_heads
        quant = d * self.config["nbits"] // 8 + 2 * es * d / self.config["q_group_size"]
        return 2 * h * quant, 2 * h * d * es

    def row_nbytes(self, spec, tokens):
        """HF never evicts; a single prefill of `tokens` holds them all quantized (the least it holds)."""
        return int(tokens * self._token_nbytes(spec)[0])

    def row_max_nbytes(self, spec, tokens):
        """Later blocks sit in the dense buffer until a flush: at most every token in its larger form."""
        return int(tokens * max(self._token_nbytes(spec)))

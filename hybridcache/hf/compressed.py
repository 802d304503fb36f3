"""HF cache layers with compressors of their own (DeepSeek-V4's `DeepseekV4HCACache` / `DeepseekV4CSACache`): a
sliding window of keys plus, per named compressor ("compressor"; CSA adds "indexer"), the running compressed entries,
the sources of the open window and (CSA) the previous window's first series.

Read from the probe's HF layer itself (nothing family-specific beyond HF's attribute names: `compressed_kv`,
`buffer_kv`, `overlap_kv`, `compress_rate`), and served by a group {"attention": sliding, <name>: compressed_kv, ...}
(cache/compressed/compressed_kv.py; hf/layers/compressed.py is HF's view of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache import NativeLayer
from hybridcache.hf.errors import BridgeError


@dataclass(frozen=True)
class CompressorShape:
    """One compressor of an HF layer: HF's name for it, its rate, entry width, whether its windows overlap (two
    series per source token), the dtype of what it stores and of its previous window's gate (which carries the
    compressor's position bias: the promotion of the two dtypes)."""

    name: str
    compress_rate: int
    entry_dim: int
    overlap: bool
    dtype: torch.dtype
    gate_dtype: torch.dtype


def compressor_shapes(layer: Any, where: str, module: Any = None) -> tuple[CompressorShape, ...] | None:
    """The compressors of an HF cache layer after the probe (None: a layer without any). `module`: the decoder layer
    it belongs to, whose `<name>.position_bias` parameters give the gate dtypes (float32 where none is found: HF keeps
    DeepSeek-V4's position biases in float32 when it loads a checkpoint, `_keep_in_fp32_modules_strict`)."""
    entries, buffers = getattr(layer, "compressed_kv", None), getattr(layer, "buffer_kv", None)
    if not (isinstance(entries, dict) and isinstance(buffers, dict) and hasattr(layer, "store_compression_weights")):
        return None
    rate, overlaps = getattr(layer, "compress_rate", None), getattr(layer, "overlap_kv", None) or {}
    shapes = []
    for name, held in entries.items():
        source = buffers.get(name)
        if not isinstance(rate, int) or not isinstance(held, torch.Tensor) or not isinstance(source, torch.Tensor):
            raise BridgeError(f"{where}: its compressor '{name}' kept nothing the bridge can read after the probe")
        overlap = name in overlaps
        entry_dim, source_dim = int(held.shape[-1]), int(source.shape[-1])
        if source_dim != entry_dim * (2 if overlap else 1):
            raise BridgeError(
                f"{where}: compressor '{name}' pools sources of width {source_dim} into entries of {entry_dim} "
                f"({'two series' if overlap else 'one series'} per token expected)"
            )
        biases = [p.dtype for n, p in _parameters(module) if n.endswith(f"{name}.position_bias")]
        gate_dtype = torch.promote_types(held.dtype, biases[0] if biases else torch.float32)
        shapes.append(CompressorShape(str(name), rate, entry_dim, overlap, held.dtype, gate_dtype))
    return tuple(shapes)


def _parameters(module: Any) -> list:
    return list(module.named_parameters()) if isinstance(module, torch.nn.Module) else []


def compressor_members(compressors: tuple[CompressorShape, ...]) -> dict[str, NativeLayer]:
    """Our native `compressed_kv` layers, one per compressor, by HF's name."""
    return {
        c.name: NativeLayer(
            "compressed_kv",
            dict(
                compress_rate=c.compress_rate,
                entry_dim=c.entry_dim,
                overlap=c.overlap,
                dtype=c.dtype,
                overlap_gate_dtype=c.gate_dtype,
            ),
        )
        for c in compressors
    }

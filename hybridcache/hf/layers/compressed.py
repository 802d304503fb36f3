"""A DeepSeek-V4 compressed-attention cache layer (HF's `DeepseekV4HCACache` / `DeepseekV4CSACache`) served by a group
of ours: `attention` (the sliding window; K = V, HF hands the same tensor twice) and one `compressed_kv` per
compressor (hf/compressed.py).

HF's compressor calls, in order, per compressor and forward: `store_compression_weights(name, kv, gate)` (the
sources of the windows this block closes, the open window's held sources first), with overlap
`update_overlap_state(name, chunk_kv, chunk_gate, head_dim)` (the previous forward's last window; this one's is kept),
then `update_compressor_states(name, compressed)` (every entry). The first two read our layer; the third feeds it
the block's sources, new entries and last window in one update (staged with the rest of the block). HF's
attributes (`compressed_kv`, `buffer_kv`, `buffer_gate`, `entry_count`, `overlap_kv`, `overlap_gate`: dicts by
compressor) read what our layers hold.

The compressed entries join attention inside HF's mask (the model concatenates them with a causal bias after
`update`), so these layers attend with HF's mask, which describes them only in their native layout (sliding window,
dynamic storage: bridge_cache.py refuses any other config for them).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.hf.compressed import CompressorShape
from hybridcache.hf.errors import BridgeError
from hybridcache.hf.layers.attention import BridgeAttentionLayer
from hybridcache.hf.layout import AttentionShape


class BridgeCompressedLayer(BridgeAttentionLayer):
    """HF's view of an {attention, <compressor>, ...} group of ours."""

    def __init__(
        self, bridge: Any, index: int, shape: AttentionShape, compressors: tuple[CompressorShape, ...]
    ) -> None:
        super().__init__(bridge, index, shape, "sliding", member="attention")
        self.compressors = {c.name: c for c in compressors}
        self.compress_rate = compressors[0].compress_rate  # HF's attribute (every compressor of a layer shares it)
        self.sliding_window = shape.size
        self._sources: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this block's sources, until fed
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this block's last closed window

    def __repr__(self) -> str:
        return f"BridgeCompressedLayer({self.index}: {', '.join(self.compressors)})"

    def _compressor(self, name: str):
        if name not in self.compressors:
            raise BridgeError(
                f"decoder layer {self.index} has no compressor {name!r} (it has {', '.join(self.compressors)})"
            )
        return self.bridge.cache_layer(self.index, name)

    # -- HF's attributes, read-only: what each compressor holds since the last forward --------------------------
    def _held(self, attr: str) -> dict[str, torch.Tensor | None]:
        """HF's dict by compressor of one held tensor; `overlap_*` for the overlapping (CSA) ones only, None before
        their first window closed (and everything None before the first forward)."""
        overlap, out = attr.startswith("overlap"), {}
        for name, c in self.compressors.items():
            if overlap and not c.overlap:
                continue
            layer = None if self.bridge.hybrid is None else self.bridge.cache_layer(self.index, name)
            out[name] = None if layer is None or (overlap and layer.entry_count == 0) else getattr(layer, attr)
        return out

    @property
    def compressed_kv(self) -> dict[str, torch.Tensor | None]:
        return self._held("entries")

    @property
    def buffer_kv(self) -> dict[str, torch.Tensor | None]:
        return self._held("buffer_kv")

    @property
    def buffer_gate(self) -> dict[str, torch.Tensor | None]:
        return self._held("buffer_gate")

    @property
    def entry_count(self) -> dict[str, int]:
        return {name: 0 if t is None else int(t.shape[1]) for name, t in self.compressed_kv.items()}

    @property
    def overlap_kv(self) -> dict[str, torch.Tensor | None]:
        return self._held("overlap_kv")

    @property
    def overlap_gate(self) -> dict[str, torch.Tensor | None]:
        return self._held("overlap_gate")

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """HF's contract: (the sources of the windows this block closes [B, n * r, W] each, the column of the first)."""
        self.bridge.open_block(kv.shape[1], kv.device)
        layer = self._compressor(name)
        if name in self._sources:
            raise BridgeError(f"decoder layer {self.index}: compressor {name!r} was given sources twice in one forward")
        ready = layer.ready(kv, gate)  # validates shapes, dtype and device: a named error before anything is kept
        self._sources[name] = (kv, gate)
        return ready

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """HF's contract: the previous forward's last window (kv, gate [B, r, D]; (None, None) before the first);
        this block's last window (`chunk_*[:, -1, :, :head_dim]`) is kept for the next."""
        layer = self._compressor(name)
        if name not in self._sources:
            raise BridgeError(f"decoder layer {self.index}: update_overlap_state({name!r}) before its sources")
        prior = layer.previous_window()
        self._last[name] = (chunk_kv[:, -1, :, :head_dim], chunk_gate[:, -1, :, :head_dim])
        return (None, None) if prior is None else prior

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """HF's contract: add this block's entries [B, n, D]; returns every entry [B, E + n, D]."""
        layer = self._compressor(name)
        sources = self._sources.get(name)
        if sources is None:
            raise BridgeError(f"decoder layer {self.index}: update_compressor_states({name!r}) before its sources")
        entries = layer.update(*sources, compressed, self._last.get(name))
        del self._sources[name]
        self._last.pop(name, None)
        return entries

    def end_block(self) -> None:
        super().end_block()
        self._sources.clear()
        self._last.clear()

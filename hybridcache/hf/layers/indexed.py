"""DeepSeek sparse attention's cache layer (HF's DynamicIndexedLayer: DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2):
keys and values, plus the indexer keys [B, S, D] its lightning indexer scores every cached token with. Served by a
group of two of our layers: `attention`, and `indexer` (a full-attention layer of one head holding the indexer keys,
as hybridcache's own GLM5-Next does).

The indexer's top-k selection reaches attention inside HF's mask (the model removes unselected slots from it), so
these layers attend with HF's mask, which describes them only in their native layout: full attention, dynamic
storage (bridge_cache.py refuses any other config for them)."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.hf.layers.attention import BridgeAttentionLayer
from hybridcache.hf.layout import AttentionShape


class BridgeIndexedLayer(BridgeAttentionLayer):
    """HF's view of an {attention, indexer} group of ours."""

    def __init__(self, bridge: Any, index: int, shape: AttentionShape, indexer_dim: int) -> None:
        super().__init__(bridge, index, shape, "full", member="attention")
        self.indexer_dim = indexer_dim
        self.indexer_position_ids = None  # HF's optional attribute (no family we serve sets it)

    def __repr__(self) -> str:
        return f"BridgeIndexedLayer({self.index})"

    @property
    def indexer_keys(self) -> torch.Tensor | None:
        if self.bridge.hybrid is None:
            return None
        return self.bridge.cache_layer(self.index, "indexer").keys[:, 0]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Add the block's indexer keys [B, T, D]; returns every cached one [B, S, D] (HF's contract)."""
        self.bridge.open_block(indexer_key_states.shape[1], indexer_key_states.device)
        layer = self.bridge.cache_layer(self.index, "indexer")
        k = indexer_key_states[:, None]  # [B, 1, T, D]: one head
        k = k if k.dtype == layer.spec.dtype else k.to(layer.spec.dtype)
        view = layer.update(k, k)
        keys = view.keys[:, 0]
        return keys if keys.dtype == indexer_key_states.dtype else keys.to(indexer_key_states.dtype)

"""One attention cache of an HF decoder layer, served by our attention cache layer behind HF's `CacheLayerMixin`.

`update(k, v)` feeds the block's keys and values [B, H, T, D] to our layer (its pattern, storage and eviction are
ours) and returns what the block attends to: our view's keys and values, whose slots and positions are ours, not
HF's column layout. So HF's mask (built from `get_mask_sizes` for HF's own layouts) does not describe them; the
bridge's attention function (attention_fn.py) masks them with the view's own mask instead. Keys and values of
different widths (multi-head latent attention) are zero-padded to the layer's width on the way in and sliced back.

HF's whole-cache operations (crop, reorder, batch repeat / select, reset) act on our `Cache` as one transaction
(bridge_cache.py); the per-layer forms are not used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from hybridcache.hf.errors import BridgeError
from hybridcache.hf.layers.whole_cache import whole_cache_only
from hybridcache.hf.layout import AttentionShape


def _widen(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    x = x if x.dtype == dtype else x.to(dtype)
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


@whole_cache_only
class BridgeAttentionLayer(CacheLayerMixin):
    """HF's view of one of our attention cache layers (decoder layer `index`, group member `member` or None)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False  # storage is ours, allocated when the first block's batch is known

    def __init__(self, bridge: Any, index: int, shape: AttentionShape, native_type: str, member=None):
        # bridge: the BridgeCache (bridge_cache.py) owning this adapter
        self.bridge, self.index, self.shape, self.attention_member = bridge, index, shape, member
        self.is_sliding = native_type != "full"
        self.device = shape.device

    @property
    def is_initialized(self) -> bool:  # HF checks it before reading `keys` (Mllama's cross-attention test)
        return self.bridge.hybrid is not None

    @is_initialized.setter
    def is_initialized(self, value) -> None:  # the mixin's __init__ assigns it: the cache's state decides
        pass

    def __repr__(self) -> str:
        return f"BridgeAttentionLayer({self.index}: {self.bridge.layer_type(self.index, self.attention_member)})"

    def _attention_layer(self):
        return self.bridge.cache_layer(self.index, self.attention_member)

    # -- HF's CacheLayerMixin --------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """As HF's layers: after this forward's `update`, what it returned (held + the block); else the held keys
        [B, H, S, Dk] (decoded); None before the first block."""
        if self._returned is not None:
            return self._returned[0]
        if self.bridge.hybrid is None:
            return None
        return self._attention_layer().keys[..., : self.shape.key_dim]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ and HF's resets assign None: nothing to do
        if value is not None:
            raise BridgeError("the bridge's cache layers hold their keys themselves; they cannot be assigned")

    @property
    def values(self) -> torch.Tensor | None:
        if self._returned is not None:
            return self._returned[1]
        if self.bridge.hybrid is None:
            return None
        return self._attention_layer().values[..., : self.shape.value_dim]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise BridgeError("the bridge's cache layers hold their values themselves; they cannot be assigned")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: our cache is built by the first `update` of a forward, on the device of its keys."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.bridge.open_block(key_states.shape[-2], key_states.device)
        layer = self._attention_layer()
        width, dtype = layer.spec.head_dim, layer.spec.dtype
        view = layer.update(_widen(key_states, width, dtype), _widen(value_states, width, dtype))
        keys, values = view.keys, view.values
        if keys.shape[-1] != self.shape.key_dim:
            keys = keys[..., : self.shape.key_dim]
        if values.shape[-1] != self.shape.value_dim:
            values = values[..., : self.shape.value_dim]
        if keys.dtype != key_states.dtype:
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
        self.bridge.record_view(keys, view, layer)
        self._returned = (keys, values)  # dropped when the block ends (bridge_cache.py)
        return keys, values

    _returned: tuple[torch.Tensor, torch.Tensor] | None = None

    def end_block(self) -> None:
        self._returned = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(slots `update` will return, the column of the first): held + the block, starting at columns - held.
        Exact for dynamic storage of the built-in patterns, whose held slots are the last columns in order (what HF's
        masks need in families that mask attention themselves); elsewhere the bridge's attention function replaces
        HF's mask with the view's own and these sizes only keep HF's mask code in bounds."""
        if self.bridge.hybrid is None:
            return query_length, 0
        held = int(self._attention_layer().key_positions().shape[-1])
        return held + query_length, max(self.bridge.columns - held, 0)

    def get_seq_length(self) -> int:
        """Columns fed so far, padding included (what HF's generate slices new input ids by); after this layer's
        `update` in a forward, the block's columns included, as HF's layers count them (GLM5-Next's indexer reads
        it there)."""
        return self.bridge.columns + (self.bridge.block_tokens if self._returned is not None else 0)

    def get_max_length(self) -> int:
        limit = getattr(self.bridge.plan_spec(self.index, self.attention_member), "max_length", None)
        return -1 if limit is None else int(limit)

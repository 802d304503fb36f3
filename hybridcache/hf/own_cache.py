"""MiniMax (transformers' `MiniMaxForCausalLM`): its model takes no cache but its own `MiniMaxCache`, a
DynamicCache for the attention layers plus one linear-attention state per lightning layer, read and written with
`get_linear_cache(i)` / `set_linear_cache(i, state)` (None read back: no state yet, so the layer runs its blockwise
prefill; a state: its per-token recurrence S <- exp(-slope) * S + k^T v, in the model's dtype, [B, H, D, D]).

The bridge probes it with that cache (layout.py: `own_cache`, `linear_state`) and hands it a `BridgeMiniMaxCache`,
a BridgeCache that is also a MiniMaxCache; each lightning layer's state is our `linear_attention` type
(cache/recurrent/linear_attention.py) behind `BridgeLinearStateLayer`, so rollback (crop), state codecs and
offload apply as on every recurrent type.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.hf.errors import BridgeError
from hybridcache.hf.layers.state import BridgeStateLayer
from hybridcache.hf.layout import OWN_CACHE_FAMILIES, StateShape

FAMILIES = OWN_CACHE_FAMILIES  # model types whose model checks isinstance(cache, MiniMaxCache)


class BridgeLinearStateLayer(BridgeStateLayer):
    """HF's view of one of our `linear_attention` layers: a single recurrent state and no conv state. Like
    BridgeStateLayer it keeps a working copy in HF's layout during a block and feeds our layer at its end."""

    def __init__(self, bridge: Any, index: int, shape: StateShape) -> None:
        if shape.conv or list(shape.recurrent) != [0]:
            raise BridgeError(f"layer {index}: a linear-attention layer keeps one recurrent state and no conv state")
        self.bridge, self.index, self.state_shape, self.state_member = bridge, index, shape, None
        self.number_of_states = 1
        self.record_past = False
        self.device = shape.device
        self.dtype = shape.recurrent[0][1]
        self.conv_kernel_size = {}
        self._conv = None  # never used: no conv state
        self._rec: torch.Tensor | None = None  # the open block's working state [B, H, Dk, Dv], HF's dtype
        self._written = False

    def _working(self) -> tuple[None, torch.Tensor]:
        if self._rec is None:
            self.bridge.open_block(device=self.bridge.layer_device(self.index))
            shape, dtype = self.state_shape.recurrent[0]
            held = self._state_layer().states["recurrent"]
            self._rec = held.to(dtype, copy=True).reshape(held.shape[0], *shape)
        return None, self._rec

    def get_linear_cache(self) -> torch.Tensor | None:
        """MiniMaxCache's contract: None while the layer holds no state (an empty cache: HF's blockwise prefill),
        else the state."""
        rec = self._working()[1]
        return rec if self._written or self.bridge.columns > 0 else None

    def set_linear_cache(self, state: torch.Tensor) -> None:
        shape, _ = self.state_shape.recurrent[0]
        if not isinstance(state, torch.Tensor) or tuple(state.shape[1:]) != shape:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise BridgeError(
                f"layer {self.index}: a linear-attention state must be [B, {', '.join(map(str, shape))}], got {got}"
            )
        self.bridge.check_device(state.device)
        self._working()
        self._rec = state
        self._written = True

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.set_linear_cache(recurrent_states)
        return recurrent_states

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        raise BridgeError(f"layer {self.index}: a linear-attention layer keeps no conv state")

    def flush(self) -> None:
        """Feed the block's state to our layer (only if the model wrote one: a layer left untouched is not fed, and
        our cache then refuses to commit the block)."""
        if not self._written:
            return
        layer = self._state_layer()
        shape, dtype = layer.spec.state_shapes()["recurrent"]
        layer.update(recurrent=self._rec.to(dtype).reshape(self._rec.shape[0], *shape))

    def end_block(self) -> None:
        self._rec = None
        self._written = False


def bridge_cache_class(model_type: str, base: type) -> type:
    """The BridgeCache class for a family: `base` itself, or for MiniMax one that is also a MiniMaxCache."""
    if model_type not in FAMILIES:
        return base
    return _minimax_class(base)


_CLASSES: dict[type, type] = {}


def _minimax_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls
    from transformers.cache_utils import Cache as HFCache
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class BridgeMiniMaxCache(base, MiniMaxCache):
        """A BridgeCache that MiniMax's model accepts (it checks isinstance(cache, MiniMaxCache)); its lightning
        layers read and write their states through our layers. Every whole-cache operation is BridgeCache's."""

        is_croppable = HFCache.is_croppable  # MiniMaxCache says False; ours can with rollback

        def __len__(self) -> int:
            return len(self.layers)

        def __iter__(self):
            raise BridgeError("a BridgeCache is not a legacy tuple cache: read its layers or cache.hybrid instead")

        def _linear_layer(self, layer_idx: int) -> BridgeLinearStateLayer:
            layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
            if not isinstance(layer, BridgeLinearStateLayer):
                raise BridgeError(f"minimax: decoder layer {layer_idx} is not a lightning (linear-attention) layer")
            return layer

        def get_linear_cache(self, layer_idx: int):
            return self._linear_layer(layer_idx).get_linear_cache()

        def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
            self._linear_layer(layer_idx).set_linear_cache(linear_cache)

    cls = _CLASSES[base] = BridgeMiniMaxCache
    return cls

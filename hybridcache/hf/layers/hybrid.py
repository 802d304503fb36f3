"""An HF "hybrid" decoder layer (FalconH1's parallel Mamba2 + attention, Zamba's shared attention blocks): one HF
cache layer with both interfaces, served by a group of two of our cache layers ({"attention", <state type>})."""

from __future__ import annotations

from typing import Any

from hybridcache.hf.layers.attention import BridgeAttentionLayer
from hybridcache.hf.layers.state import BridgeStateLayer
from hybridcache.hf.layout import AttentionShape, StateShape


class BridgeHybridLayer(BridgeStateLayer, BridgeAttentionLayer):
    """Attention calls go to the group's `attention` member, state calls to its recurrent member."""

    is_compileable = False
    supports_early_init = False

    def __init__(
        self, bridge: Any, index: int, attention: AttentionShape, states: StateShape, state_member: str
    ) -> None:
        BridgeAttentionLayer.__init__(self, bridge, index, attention, "full", member="attention")
        BridgeStateLayer.__init__(self, bridge, index, states, member=state_member)

    def __repr__(self) -> str:
        return f"BridgeHybridLayer({self.index})"

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return BridgeStateLayer.is_croppable.fget(self)

    def end_block(self) -> None:
        BridgeStateLayer.end_block(self)
        BridgeAttentionLayer.end_block(self)

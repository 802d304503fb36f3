"""An HF decoder layer with several linear-attention states (Inkling: four short convolutions beside its attention;
ZAYA: a conv state and the previous token's delayed value projection beside its attention), served by a group of
our cache layers: `attention` and one `conv` member per state (native.py, `multi_state_members`).

Each HF state is one `StatePart`: during a block it keeps a working copy in HF's layout (made from our member's held
conv state on first access, replaced by `update_*`, mutated in place by HF's decode kernels) and feeds our member
once when the block ends, as the single-state adapter does (state_layer.py). A conv state that HF keeps K wide is
held K-1 wide (the oldest column is never read, native.py); a 1-d state [C] (ZAYA's delayed value) is a width-2
conv state [C, 1]: the previous token's input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hybridcache.hf.errors import BridgeError
from hybridcache.hf.layers.attention import BridgeAttentionLayer
from hybridcache.hf.layers.state import _ByIndex
from hybridcache.hf.layers.whole_cache import whole_cache_only
from hybridcache.hf.layout import AttentionShape
from hybridcache.hf.native import PartSpec


class StatePart:
    def __init__(self, bridge: Any, index: int, spec: PartSpec) -> None:
        self.bridge, self.index, self.spec = bridge, index, spec
        self.work: torch.Tensor | None = None  # HF's layout: [B, C, K] or [B, C]
        self.written = False

    def layer(self):
        return self.bridge.cache_layer(self.index, self.spec.member)

    def working(self) -> torch.Tensor:
        if self.work is None:
            self.bridge.open_block(device=self.bridge.layer_device(self.index))
            held = self.layer().states["conv"].to(self.spec.dtype)  # [B, C, keep]
            if self.spec.kind == "recurrent":
                self.work = held[..., -1].clone()
            else:
                self.work = F.pad(held, (self.spec.width - held.shape[-1], 0))  # zero columns first (never read)
        return self.work

    def update(self, new: torch.Tensor) -> torch.Tensor:
        """HF's rules (cache_utils' linear-attention layer): a conv state appends the new inputs to the previous
        window (or left-pads them to K in the first block) and keeps the last K; a recurrent state is replaced."""
        self.bridge.check_device(new.device)
        if self.spec.kind == "recurrent":
            self.working()
            self.work, self.written = new, True
            return new
        k = self.spec.width
        if self.bridge.columns > 0 or self.written:
            full = torch.cat([self.working().to(new.dtype), new], dim=-1)
        else:
            self.working()
            full = new if new.shape[-1] >= k else F.pad(new, (k - new.shape[-1], 0))
        self.work, self.written = full[..., -k:].clone(), True
        return full

    def flush(self) -> None:
        if self.work is None:
            return
        layer = self.layer()
        (_, keep), dtype = layer.spec.state_shapes()["conv"]
        work = self.work[..., None] if self.spec.kind == "recurrent" else self.work[..., self.work.shape[-1] - keep :]
        layer.update(conv=work.to(dtype))

    def end_block(self) -> None:
        self.work, self.written = None, False


@whole_cache_only
class BridgeMultiStateLayer(LinearAttentionCacheLayerMixin, BridgeAttentionLayer):
    """HF's view of a group {attention, one conv member per state}: attention calls go to `attention`, state calls
    by their `state_idx` to that state's part."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, bridge: Any, index: int, attention: AttentionShape, parts: tuple[PartSpec, ...]) -> None:
        BridgeAttentionLayer.__init__(self, bridge, index, attention, "full", member="attention")
        self.conv_parts = {p.state_idx: StatePart(bridge, index, p) for p in parts if p.kind == "conv"}
        self.rec_parts = {p.state_idx: StatePart(bridge, index, p) for p in parts if p.kind == "recurrent"}
        self.number_of_states = max([*self.conv_parts, *self.rec_parts]) + 1
        self.record_past = False
        self.conv_kernel_size = {i: part.spec.width for i, part in self.conv_parts.items()}

    def __repr__(self) -> str:
        return f"BridgeMultiStateLayer({self.index}: {len(self.conv_parts)} conv, {len(self.rec_parts)} recurrent)"

    def _parts(self) -> list[StatePart]:
        return [*self.conv_parts.values(), *self.rec_parts.values()]

    # -- HF's attributes (its mixin's __init__ assigns dicts: ignored) -------------------------------------------
    @property
    def has_previous_state(self) -> Mapping[int, bool]:
        def previous(i: int) -> bool:
            parts = [p for p in (self.conv_parts.get(i), self.rec_parts.get(i)) if p is not None]
            return self.bridge.columns > 0 or any(p.written for p in parts)

        return _ByIndex(previous, self.number_of_states)

    @has_previous_state.setter
    def has_previous_state(self, value) -> None:
        pass

    @property
    def conv_states(self) -> Mapping[int, torch.Tensor | None]:
        return _ByIndex(lambda i: self.conv_parts[i].working() if i in self.conv_parts else None, self.number_of_states)

    @conv_states.setter
    def conv_states(self, value) -> None:
        pass

    @property
    def recurrent_states(self) -> Mapping[int, torch.Tensor | None]:
        return _ByIndex(lambda i: self.rec_parts[i].working() if i in self.rec_parts else None, self.number_of_states)

    @recurrent_states.setter
    def recurrent_states(self, value) -> None:
        pass

    @property
    def is_conv_states_initialized(self) -> Mapping[int, bool]:
        return _ByIndex(lambda i: i in self.conv_parts, self.number_of_states)

    @is_conv_states_initialized.setter
    def is_conv_states_initialized(self, value) -> None:
        pass

    @property
    def is_recurrent_states_initialized(self) -> Mapping[int, bool]:
        return _ByIndex(lambda i: i in self.rec_parts, self.number_of_states)

    @is_recurrent_states_initialized.setter
    def is_recurrent_states_initialized(self, value) -> None:
        pass

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return all(getattr(self.bridge.plan_spec(self.index, p.spec.member), "rollback", 0) for p in self._parts())

    # -- HF's state updates -------------------------------------------------------------------------------------
    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: our cache is built by the first forward (bridge_cache.py)."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self.conv_parts[state_idx].update(conv_states)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self.rec_parts[state_idx].update(recurrent_states)

    # -- the block's end (bridge_cache.py) ------------------------------------------------------------------------
    def flush(self) -> None:
        for part in self._parts():
            part.flush()

    def end_block(self) -> None:
        for part in self._parts():
            part.end_block()
        BridgeAttentionLayer.end_block(self)

    def activate_past_recording(self) -> None:
        raise BridgeError(
            "HF's past recording (assisted decoding) is not used by the bridge: roll recurrent states back with our "
            "`rollback: k` instead (cache config {'recurrent': {'rollback': k}}, then cache.crop)"
        )

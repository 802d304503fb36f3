"""The linear-attention states of an HF decoder layer, held by our recurrent cache layer behind HF's
`LinearAttentionCacheLayerMixin`.

HF mixers read states (`cache.get_conv_state` / `get_recurrent_state`, i.e. `layer.conv_states[0]`), update them
in place in their decode step, or hand new ones over (`update_conv_state`, `update_recurrent_state`). So during a
block the adapter keeps working copies in HF's layout: made from our layer's held states (decoded by its codec) on
first access, replaced by the `update_*` calls, mutated in place by HF's kernels. When the block ends the working
states are fed to our layer in one `update(conv=..., <state>=...)`, which stores them (encoded, checkpointed,
offloaded, as configured) and commits with every other layer. Our layer's own storage is never handed to HF.

Layouts: the recurrent state is the same tensor in both; HF's conv state keeps the last K inputs, ours the last K-1
(the oldest is never read by a width-K causal conv's next step), so the adapter drops HF's oldest column when it
stores and puts back a zero column when it hands a state out (native.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hybridcache.hf.errors import BridgeError
from hybridcache.hf.layers.whole_cache import whole_cache_only
from hybridcache.hf.layout import StateShape


class _ByIndex(Mapping):
    """A read-only {state_idx: value} view computed on access (HF indexes `layer.conv_states[0]`)."""

    def __init__(self, get: Callable[[int], Any], n: int = 1) -> None:
        self._get, self._n = get, n

    def __getitem__(self, i: int) -> Any:
        if i not in range(self._n):
            raise KeyError(i)
        return self._get(i)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._n))

    def __len__(self) -> int:
        return self._n


@whole_cache_only
class BridgeStateLayer(LinearAttentionCacheLayerMixin):
    """HF's view of one of our recurrent cache layers (decoder layer `index`, group member `member` or None)."""

    supports_early_init = False

    def __init__(self, bridge: Any, index: int, shape: StateShape, member: str | None = None) -> None:
        self.bridge, self.index, self.state_shape, self.state_member = bridge, index, shape, member
        self.number_of_states = 1
        self.record_past = False
        self.device = shape.device
        self.dtype = shape.conv[0][1]
        self.conv_kernel_size = {0: shape.conv[0][0][-1]}
        self._conv: torch.Tensor | None = None  # working states of the open block, HF layout [B, C, K] / [B, ...]
        self._rec: torch.Tensor | None = None
        self._written = False  # an update_* call happened in this block (HF: has_previous_state becomes True)

    def __repr__(self) -> str:
        return f"BridgeStateLayer({self.index}: {self.bridge.layer_type(self.index, self.state_member)})"

    def _state_layer(self):
        return self.bridge.cache_layer(self.index, self.state_member)

    @property
    def _names(self) -> tuple[str, str | None]:
        """Our layer's state names: ("conv", the recurrent state's name or None); fixed by the plan."""
        names = self.__dict__.get("_state_names")
        if names is None:
            rest = [n for n in self.bridge.plan_spec(self.index, self.state_member).state_shapes() if n != "conv"]
            names = self.__dict__["_state_names"] = ("conv", rest[0] if rest else None)
        return names

    # -- HF's attributes -----------------------------------------------------------------------------------------
    @property
    def has_previous_state(self) -> Mapping[int, bool]:
        return _ByIndex(lambda i: self._written or self.bridge.columns > 0)

    @has_previous_state.setter
    def has_previous_state(self, value) -> None:  # the mixin's __init__ assigns a dict: ignored
        pass

    @property
    def conv_states(self) -> Mapping[int, torch.Tensor | None]:
        return _ByIndex(lambda i: self._working()[0])

    @conv_states.setter
    def conv_states(self, value) -> None:
        pass

    @property
    def recurrent_states(self) -> Mapping[int, torch.Tensor | None]:
        return _ByIndex(lambda i: self._working()[1])

    @recurrent_states.setter
    def recurrent_states(self, value) -> None:
        pass

    @property
    def is_conv_states_initialized(self) -> Mapping[int, bool]:
        return _ByIndex(lambda i: True)

    @is_conv_states_initialized.setter
    def is_conv_states_initialized(self, value) -> None:
        pass

    @property
    def is_recurrent_states_initialized(self) -> Mapping[int, bool]:
        return _ByIndex(lambda i: self.state_shape.recurrent != {})

    @is_recurrent_states_initialized.setter
    def is_recurrent_states_initialized(self, value) -> None:
        pass

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether crop can rewind this layer: with `rollback` (our recurrent layers' own rollback)."""
        return bool(getattr(self.bridge.plan_spec(self.index, self.state_member), "rollback", 0))

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False

    # -- working states --------------------------------------------------------------------------------------
    def _working(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This block's working states in HF's layout, made from our held states on first access."""
        if self._conv is None:
            self.bridge.open_block(device=self.bridge.layer_device(self.index))
            conv_name, rec_name = self._names
            held = self._state_layer().states
            (_, k), conv_dtype = self.state_shape.conv[0][0], self.state_shape.conv[0][1]
            conv = held[conv_name].to(conv_dtype)
            self._conv = F.pad(conv, (k - conv.shape[-1], 0))  # [B, C, K]: a zero column first (never read)
            if rec_name is not None:
                shape, dtype = self.state_shape.recurrent[0]
                rec = held[rec_name]
                self._rec = rec.to(dtype, copy=True).reshape(rec.shape[0], *shape)  # our layout may group dims
        return self._conv, self._rec

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        """Nothing to do: our layer was allocated with the cache."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """HF's rule: with a previous state, the new inputs are appended to it and the full window returned;
        without one, the inputs themselves (left-padded to K). The working state keeps the last K."""
        self.bridge.check_device(conv_states.device)
        k = self.conv_kernel_size[0]
        if self.bridge.columns > 0 or self._written:
            full = torch.cat([self._working()[0].to(conv_states.dtype), conv_states], dim=-1)
        else:
            self._working()
            full = conv_states if conv_states.shape[-1] >= k else F.pad(conv_states, (k - conv_states.shape[-1], 0))
        self._conv = full[..., -k:].clone()
        self._written = True
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.bridge.check_device(recurrent_states.device)
        self._working()
        self._rec = recurrent_states
        self._written = True
        return recurrent_states

    # -- the block's end (bridge_cache.py) --------------------------------------------------------------------
    def flush(self) -> None:
        """Feed this block's states to our layer (HF layout -> ours). A layer the model never touched in this block
        is not fed (our cache then refuses to commit the block and says which)."""
        if self._conv is None:
            return
        layer = self._state_layer()
        conv, rec = self._working()
        shapes = layer.spec.state_shapes()
        conv_name, rec_name = self._names
        (_, keep), conv_dtype = shapes[conv_name][0], shapes[conv_name][1]
        states = {conv_name: conv[..., conv.shape[-1] - keep :].to(conv_dtype)}
        if rec_name is not None:
            shape, dtype = shapes[rec_name]
            states[rec_name] = rec.to(dtype).reshape(rec.shape[0], *shape)
        layer.update(**states)

    def end_block(self) -> None:
        self._conv = self._rec = None
        self._written = False

    def activate_past_recording(self) -> None:
        raise BridgeError(
            "HF's past recording (assisted decoding) is not used by the bridge: roll recurrent states back with our "
            "trails instead (cache config {'recurrent': {'rollback': k}}, then cache.crop)"
        )

"""The narrow view of the cache the fast path works through: reserve a slot, write it, let the cache commit it.

The kernels write a decode token's keys and values straight into cache storage instead of handing them to
`update`. They need exactly these methods of the cache (hybridcache/cache/attention/layer.py,
cache/core/decode_feed.py implement them today); the cache may change anything else:
- one step, one layer: `decode_slot()` reserves the open one-token block's slot and returns (view, slot); the
  block's commit (`Cache.end_block`) keeps it, its abort drops it;
- many steps (decode_run.py): `Cache.reserve_decode(n)` holds the cache with room for n tokens after each layer's
  held slots (one `Reserved` per attention layer), the kernels write them in turn, `Cache.feed_reserved(ids)`
  feeds the n tokens as one block (None: nothing) and lets go;
- a recurrent layer in such a run (`RunStates`, cache/recurrent/run_states.py): a ring of state buffers apart from
  what the layer holds; step j reads `read(j)` and writes `write(j)`, and the feed commits the last step's states
  (and a checkpoint trail) as n one-token blocks would. A layer that cannot (a lossy codec, offload) declines.
`AttentionCacheLayer` and `Cache` satisfy these protocols (tests/ops/test_accel_seams.py checks it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


class SlotView(Protocol):
    """What an attention block attends to (cache/attention/view.py AttentionView): keys / values [B, H, S, D] and
    `pattern()`: (query positions [B, T], key positions [B, S], pattern name, window or chunk) or None."""

    keys: torch.Tensor
    values: torch.Tensor

    def pattern(self) -> tuple[torch.Tensor, torch.Tensor, str, int] | None: ...


class ReservedSlots(Protocol):
    """reserve_decode's per layer: the buffers behind keys, values [B, H, S', D] and key_pos [B, S'], the held
    slots [start, end) in them, room for the reserved tokens from `end` on (cache/attention/slots.py Reserved)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_pos: torch.Tensor
    start: int
    end: int


class RunStates(Protocol):
    """reserve_decode's per recurrent layer: the rings [r, B, ...] of its states by name (float32, contiguous; r >= 2)
    for up to `tokens` steps; step j reads `read(j)` and writes `write(j)` ([B, ...] each, views of the rings)."""

    rings: dict[str, torch.Tensor]
    tokens: int

    def read(self, step: int) -> dict[str, torch.Tensor]: ...

    def write(self, step: int) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class AttentionSlots(Protocol):
    """An attention cache layer as the one-step kernels see it (and its spec's `kernel_pattern()`, `dtype`)."""

    spec: Any

    def decode_slot(self) -> tuple[SlotView, int] | None: ...

    def update(self, k: torch.Tensor, v: torch.Tensor) -> SlotView: ...


@runtime_checkable
class ReservingCache(Protocol):
    """A Cache as a decode run sees it: its entries (one per decoder layer) and attention layers, the sequence
    state (`seq.seen` [B], `seq.block`: the open block or None), and the reservation of many steps."""

    seq: Any
    entries: list[Any]
    layers: list[Any]

    def reserve_decode(self, tokens: int) -> list[ReservedSlots | RunStates] | None: ...

    def feed_reserved(self, ids: torch.Tensor | None) -> None: ...


@runtime_checkable
class StateSlots(Protocol):
    """A recurrent cache layer as the recurrent mixers' one-call steps see it (accel/mixers/recurrent.py):
    `states` (name -> the current state, e.g. "conv" [B, C, K-1], "ssm" [B, H, P, N], in the spec's dtypes) and
    `update(**states)`, which takes the new states of the open block and commits them with it (a failed block drops
    them); `trail_length(tokens)`: how many interior states a block hands over (0 for one token)."""

    @property
    def states(self) -> dict[str, torch.Tensor]: ...

    def update(self, valid: Any = None, trail: Any = None, **new_states: torch.Tensor) -> None: ...

    def trail_length(self, tokens: int) -> int: ...


_STATE_TYPES: dict[type, bool] = {}


def holds_states(layer: Any) -> bool:
    """Whether `layer` is a StateSlots, judged on its class once (an isinstance check would evaluate `states`)."""
    kind = type(layer)
    ok = _STATE_TYPES.get(kind)
    if ok is None:
        ok = _STATE_TYPES[kind] = all(hasattr(kind, n) for n in ("states", "update", "trail_length"))
    return ok

"""What `RecurrentCacheLayer.reserve_slots` hands a decode run (accel/runs/decode_run.py): buffers a kernel reads and
writes
a run's states in, apart from what the layer holds, so the layer can later commit the run as one block.

A ring of r state buffers per state name: before the run, the layer copies its held states into the last one; step j
reads ring[(j - 1) % r] and writes ring[j % r]. After n steps ring[(n - 1) % r] holds the states after the run, and the
r - 1 buffers before it the states after the steps before (what a checkpoint trail keeps). The layer's held states
are never written: an abandoned run leaves it as it was.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ReservedStates(NamedTuple):
    """reserve_slots of a recurrent layer: the ring [r, B, ...] (float32, contiguous) of each state, by name, for up
    to `tokens` steps."""

    rings: dict[str, torch.Tensor]
    tokens: int

    @property
    def size(self) -> int:
        """r: buffers per state (>= 2, so no step reads the buffer it writes)."""
        return next(iter(self.rings.values())).shape[0]

    def read(self, step: int) -> dict[str, torch.Tensor]:
        """The states step `step` (0-based) reads, [B, ...] each."""
        return {name: ring[(step - 1) % ring.shape[0]] for name, ring in self.rings.items()}

    def write(self, step: int) -> dict[str, torch.Tensor]:
        """Where step `step` writes its new states, [B, ...] each."""
        return {name: ring[step % ring.shape[0]] for name, ring in self.rings.items()}

"""What both kinds of decode run share (decode_run.DecodeRun: Gemma 3's layer records; program_run.ProgramRun: a
program of pre-norm records): the first step's checks, holding the cache's reservation while the first records are
built, the step's rotary tables, and ending the run (its tokens fed as one block, or nothing)."""

from __future__ import annotations

import torch

from hybridcache.accel.native.kernel_calls import takes
from hybridcache.accel.slots import ReservingCache

_F32 = torch.float32


def first_step_fits(cache: ReservingCache, capacity: int, ids: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether a run can start here at all: one row of one token, float32 the kernels take, no open block, not
    under torch.compile (each kind of run adds its own conditions on the layers)."""
    return (
        capacity >= 1
        and h.dim() == 3
        and h.shape[:2] == (1, 1)
        and ids.shape == (1, 1)
        and takes(h)
        and h.is_contiguous()
        and not torch.compiler.is_compiling()
        and cache.seq.block is None
    )


class RunBase:
    """Up to `capacity` decode steps on one held cache, fed to it by `finish` (a subclass builds the first step's
    records in `_build` and runs steps)."""

    def __init__(self, cache: ReservingCache, capacity: int, pos0: torch.Tensor, ids: torch.Tensor) -> None:
        self.cache, self.capacity, self.pos0 = cache, capacity, pos0  # pos0 [B]: the first step's positions
        self.ids = ids  # [B, capacity]: the tokens fed, in order
        self.steps = 0
        self.closed = False

    @classmethod
    def _reserve_and_build(cls, cache: ReservingCache, capacity: int, ids: torch.Tensor, build):
        """Reserve `capacity` decode tokens in every layer and build the first step's records by
        `build(run, reserved)` (reserved: each cache layer's reservation, by id of the layer). None, the cache let
        go as it was, where the cache cannot reserve or `build` says False; the same on any exception, re-raised."""
        pos0 = cache.seq.seen.clone()  # [B]: each row's next position (every step is all real tokens)
        reserved = cache.reserve_decode(capacity)
        if reserved is None:
            return None
        run = cls(cache, capacity, pos0, ids.new_zeros(ids.shape[0], capacity))
        try:
            if not build(run, dict(zip(map(id, cache.layers), reserved, strict=True))):
                run.abandon()
                return None
        except BaseException:
            run.abandon()
            raise
        return run

    def _rope(self, rotary, positions: torch.Tensor):
        """cos, sin [B, 1, 1, R] for positions [B, 1], once per rotary and step ((None, None): no rotary), by the
        rotary's own tables (the step-by-step decode computes them so, for its block's positions)."""
        if rotary is None:
            return None, None
        got = self.tables.get(id(rotary))  # (the run holds its rotaries: no id is reused meanwhile)
        if got is None:
            got = self.tables[id(rotary)] = rotary.tables(positions, _F32)
        return got

    @property
    def full(self) -> bool:
        return self.steps >= self.capacity

    def finish(self) -> None:
        """Feed the run's tokens to the cache as one block (nothing when it ran no step) and let go of it."""
        if not self.closed:
            self.closed = True
            self.cache.feed_reserved(self.ids[:, : self.steps] if self.steps else None)

    def abandon(self) -> None:
        """Let go of the cache without feeding anything (what it held is unchanged)."""
        if not self.closed:
            self.closed = True
            self.cache.feed_reserved(None)

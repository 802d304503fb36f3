"""Dynamic attention storage with spare slots: blocks are appended in place, and dropping the oldest slots is a view.

A dynamic layer's dense keys, values and key positions are views [start, end) (along the slot dim) of buffers that
have spare slots after `end`. Appending a block of T tokens writes it into [end, end + T) of the buffers, which the
layer does not hold yet (an aborted block leaves nothing visible behind), and returns the views [start, end + T);
the commit makes them the layer's storage, and an eviction that keeps the newest slots (sliding, chunked) only moves
`start`. When the spare slots run out, the held slots are copied into new buffers with `spare_slots(n)` spare
slots. So a decode step copies O(1) tokens amortized instead of the whole cache twice (a cat to append, a gather to
evict): on Gemma 3 270M those copies re-read every layer's keys and values from memory each step.

The layer still holds only what its pattern needs (`nbytes()` counts the held slots); the spare slots are reported
apart (`spare_nbytes()`; the buffers have at most max(16, n / 4) slots beyond the most n the layer held in them; a
chunked layer whose chunk ended starts over at the front of its buffers). Anything that replaces the layer's tensors
(crop, row operations that change the batch, restore with other shapes, a gather) simply ends the buffers' use: the
next append copies into new ones.
"""

from __future__ import annotations

import torch

SPARE_MIN = 16  # slots
SPARE_FRACTION = 4  # at most 1/4 of the held slots spare


def spare_slots(n: int) -> int:
    return max(SPARE_MIN, n // SPARE_FRACTION)


class AppendBuffers:
    """The buffers behind some of a layer's tensors, by attribute name, with the dim that indexes slots."""

    def __init__(self, dims: dict[str, int]) -> None:
        self.dims = dims  # attribute -> slot dim (keys/values [B, H, S, D]: 2; key_pos [B, S]: 1)
        self.buffers: dict[str, torch.Tensor] = {}
        self._last: tuple[dict[str, torch.Tensor], tuple[int, int]] | None = None  # the views last handed out

    def _window(self, name: str, t: torch.Tensor) -> tuple[int, int] | None:
        """(start, end) of `t` in its buffer, or None if `t` is not a plain slot range of it."""
        buf, dim = self.buffers.get(name), self.dims[name]
        if (
            buf is None
            or t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
            or t.stride() != buf.stride()
            or t.shape[:dim] != buf.shape[:dim]
            or t.shape[dim + 1 :] != buf.shape[dim + 1 :]
        ):
            return None
        offset = t.storage_offset() - buf.storage_offset()
        if offset % buf.stride(dim):
            return None
        start = offset // buf.stride(dim)
        return start, start + t.shape[dim]

    def window(self, current: dict[str, torch.Tensor]) -> tuple[int, int] | None:
        """The common (start, end) of every current tensor in its buffer, or None."""
        last = self._last
        if last is not None and all(t is last[0].get(name) for name, t in current.items()):
            return last[1]  # the views this object made (the common case: a decode step after a commit)
        windows = {self._window(name, t) for name, t in current.items()}
        return next(iter(windows)) if len(windows) == 1 else None

    def backs(self, name: str, t: torch.Tensor) -> bool:
        return self._window(name, t) is not None

    def spare_nbytes(self, current: dict[str, torch.Tensor]) -> int:
        """Bytes of the buffers beyond the current views (0 when they no longer back them)."""
        if self.window(current) is None:
            return 0
        return sum(
            self.buffers[n].numel() * self.buffers[n].element_size() - t.numel() * t.element_size()
            for n, t in current.items()
        )

    def append(
        self, current: dict[str, torch.Tensor], new: dict[str, torch.Tensor | None], tokens: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Views of current + new along the slot dims (nothing the layer holds changes). A None in `new` leaves its
        `tokens` new slots unwritten, for the caller to fill (a kernel writing a decode token's keys in place)."""
        names = list(current)
        if tokens is None:
            tokens = new[names[0]].shape[self.dims[names[0]]]
        start, end = self._room(current, tokens)
        out = {}
        for name in names:
            buf, dim = self.buffers[name], self.dims[name]
            if new[name] is not None:
                buf.narrow(dim, end, tokens).copy_(new[name])
            out[name] = buf.narrow(dim, start, end - start + tokens)
        self._last = (out, (start, end + tokens))
        return out

    def _room(self, current: dict[str, torch.Tensor], tokens: int) -> tuple[int, int]:
        """(start, end) of the held slots in buffers with at least `tokens` slots after them: the current ones, or
        new ones holding a copy of the held slots first."""
        names = list(current)
        win = self.window(current)
        if win is not None and win[0] == win[1]:
            win = (0, 0)  # nothing held (a chunk just ended): the buffers start over
        if win is None or win[1] + tokens > self.buffers[names[0]].shape[self.dims[names[0]]]:
            held = current[names[0]].shape[self.dims[names[0]]]
            capacity = held + tokens + spare_slots(held + tokens)
            for name in names:  # new buffers: the held slots first
                t, dim = current[name], self.dims[name]
                shape = (*t.shape[:dim], capacity, *t.shape[dim + 1 :])
                buf = torch.empty(shape, dtype=t.dtype, device=t.device)
                buf.narrow(dim, 0, held).copy_(t)
                self.buffers[name] = buf
            win = (0, held)
        return win

    def reserve(self, current: dict[str, torch.Tensor], tokens: int) -> tuple[dict[str, torch.Tensor], int]:
        """Room for `tokens` slots right after the held ones, which a later `append` of that many tokens (or fewer)
        with None for the new values hands out unwritten, as they are: views of the held slots (the same values;
        in new buffers when these had no room) to hold from now on, and the held slots' start in the buffers
        (`self.buffers`)."""
        start, end = self._room(current, tokens)
        out = {name: self.buffers[name].narrow(self.dims[name], start, end - start) for name in current}
        self._last = (out, (start, end))
        return out, start

    def drop_oldest(self, current: dict[str, torch.Tensor], drop: int) -> dict[str, torch.Tensor]:
        """Views of `current` without their first `drop` slots (an eviction that keeps the newest)."""
        out = {name: t.narrow(self.dims[name], drop, t.shape[self.dims[name]] - drop) for name, t in current.items()}
        win = self.window(current)
        self._last = (out, (win[0] + drop, win[1])) if win is not None else None
        return out

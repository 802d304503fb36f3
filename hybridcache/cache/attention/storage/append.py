"""Dense dynamic attention storage appended in place: `AppendStorage` (the default of a dynamic dense layer).

Keys, values and key positions are views of buffers with spare slots (cache/storage/append_buffer.py): a block is
appended into the spare slots (no copy of what is held), an eviction that keeps the newest slots is a view, and a
decode kernel may write tokens into the slots itself (`kernel_slots`: `append` with None for k / v, `reserve`).
"""

from __future__ import annotations

import torch

from hybridcache.cache.attention.slots import Reserved
from hybridcache.cache.attention.staging import AttentionWrite, BlockWrite
from hybridcache.cache.attention.storage.codec import CodecStorage
from hybridcache.cache.attention.view import AttentionView
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.append_buffer import AppendBuffers


class AppendStorage(CodecStorage):
    """Dense keys and values [B, H, S, D] and key_pos [B, S] as views of buffers with spare slots."""

    kernel_slots = True
    drops_oldest = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.append_buffers = AppendBuffers({**{name: 2 for name in self.parts}, "key_pos": 1})

    def _current(self) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in self.append_buffers.dims}

    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        return self.append(k, v, block)

    def append(
        self, k: torch.Tensor | None, v: torch.Tensor | None, block: BlockState
    ) -> tuple[AttentionView, BlockWrite]:
        """Append the block into spare slots, staged as a block (k and v None: their slots left for the caller,
        or taken as a `reserve` caller wrote them)."""
        new = dict(zip(self.parts, (k, v)), key_pos=block.positions)
        views = self.append_buffers.append(self._current(), new, block.tokens)
        keys, values, pos = (views[name] for name in (*self.parts, "key_pos"))
        if k is None:  # the slots the caller writes
            k, v = keys.narrow(2, -block.tokens, block.tokens), values.narrow(2, -block.tokens, block.tokens)
        return AttentionView(keys, values, block.positions, pos, self.spec), BlockWrite(k, v, keys, values, pos, block)

    def reserve(self, tokens: int) -> Reserved:
        """Room for `tokens` slots right after the held ones (what is held keeps its values, maybe in new buffers)."""
        views, start = self.append_buffers.reserve(self._current(), tokens)
        self.tensors.update(views)
        (keys, values), buffers = self.parts, self.append_buffers.buffers  # (dense: one part per side)
        return Reserved(buffers[keys], buffers[values], buffers["key_pos"], start, start + self.key_pos.shape[1])

    def drop_oldest(self, n: int) -> None:
        self.tensors.update(self.append_buffers.drop_oldest(self._current(), n))

    def take(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        slots, n = self.key_pos.shape[1], index.numel()
        if (
            valid is None
            and index.dim() == 1
            and n < slots
            and torch.equal(index, torch.arange(slots - n, slots, device=index.device))
        ):
            return self.drop_oldest(slots - n)  # exactly the newest slots, in order: views, no copy
        super().take(index, valid)

    def _held_nbytes(self, name: str, t: torch.Tensor) -> int:
        if self.append_buffers.backs(name, t):  # a view of a buffer: its slots
            return t.numel() * t.element_size()
        return super()._held_nbytes(name, t)

    def spare_nbytes(self) -> int:
        return self.append_buffers.spare_nbytes(self._current())

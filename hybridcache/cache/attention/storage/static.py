"""Preallocated attention storage (`max_length` set): `StaticStorage`.

Static buffers whose slots the spec assigns (`slot_of`: linear for `full`, a ring of W / C slots for `sliding` /
`chunked`). A one-token decode block is written in place and the buffer itself is returned (`DecodeWrite` keeps
what the slot held, so an abort puts it back): no roll, no copy of the window. Longer blocks attend over a copy and
are written at commit, per row the tokens `stays_in_slots` keeps. Any codec; a residual window is a ring too.
"""

from __future__ import annotations

import torch

from hybridcache.cache.attention.staging import AttentionWrite, CropPlan, DecodeWrite, ResidualUndo
from hybridcache.cache.attention.storage.codec import SIDES, CodecStorage
from hybridcache.cache.attention.storage.protocol import Evict, Take
from hybridcache.cache.attention.view import AttentionView, _gather_slots, _slot_index
from hybridcache.cache.core.sequence import BlockState


class StaticStorage(CodecStorage):
    """Slots preallocated for `max_length` tokens (or a ring), written in place."""

    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        if not (block.all_real and block.tokens == 1):
            return super().write(k, v, block)  # attend over a copy; written at commit
        slots = self.spec.slot_of(block.positions)  # [B, 1]
        old = {name: self.tensors[name].gather(2, _slot_index(slots, self.tensors[name])) for name in self.parts}
        old_pos = self.key_pos.gather(1, slots)  # what the slot held, so an aborted block puts it back
        residual = self._write_slots(k, v, block.positions, slots)
        keys, values = self.read()
        staged = DecodeWrite(slots, old, old_pos, residual, k, v, block)
        return AttentionView(keys, values, block.positions, self.key_pos, self.spec), staged

    def _write_slots(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> ResidualUndo | None:
        """Write a decode token [B, H, 1, D] into its slots [B, 1], in place."""
        for side, x in zip(SIDES, (k, v)):
            held = self.side(side)
            for part, t in self.codec.encode(x).items():
                held[part].scatter_(2, _slot_index(slots, t), t)
        self.key_pos.scatter_(1, slots, positions)
        return None if self.window is None else self.window.write_decode(k, v, positions)

    def reapply(self, staged: AttentionWrite) -> None:
        if isinstance(staged, DecodeWrite):
            self._write_slots(staged.k, staged.v, staged.block.positions, staged.slots)

    def commit(self, staged: AttentionWrite, evict: Evict | None) -> None:
        if isinstance(staged, DecodeWrite):
            return  # written in place
        k, v, block = staged.k, staged.v, staged.block
        size = self.key_pos.shape[1]
        pos = block.positions  # [B, T]
        keep = self.spec.stays_in_slots(pos, block.seen_after[:, None]) & (pos >= 0)
        slots = torch.where(keep, self.spec.slot_of(pos.clamp(min=0)), size)  # [B, T]; size = nowhere
        source = torch.full((pos.shape[0], size + 1), -1, dtype=torch.long, device=self.device)
        source.scatter_(1, slots, torch.arange(pos.shape[1], device=self.device).expand_as(slots))
        source = source[:, :size]  # [B, S]: which block token lands in each slot, -1 for none
        hit = source >= 0
        for side, x in zip(SIDES, (k, v)):
            enc = self.codec.encode(x)
            for part, dst in self.side(side).items():
                new = _gather_slots(enc[part], source.clamp(min=0))  # [B, H, S, ...]
                mask = hit[:, None, :].reshape(*hit.shape[:1], 1, size, *([1] * (dst.dim() - 3)))
                dst.copy_(torch.where(mask, new, dst))
        self.key_pos.copy_(torch.where(hit, pos.gather(1, source.clamp(min=0)), self.key_pos))
        if self.window is not None:
            self.window.commit_static(k, v, pos, block.seen_after)

    def abort(self, staged: AttentionWrite) -> None:
        if not isinstance(staged, DecodeWrite):
            return  # nothing was written
        self.key_pos.scatter_(1, staged.slots, staged.old_pos)
        for name, t in staged.old.items():  # (empty where an offload tier dropped the written copy)
            self.tensors[name].scatter_(2, _slot_index(staged.slots, t), t)
        if self.window is not None:
            self.window.undo_decode(staged.residual)

    def crop(self, plan: CropPlan, take: Take) -> None:
        if self.window is not None:
            self.window.crop(plan.seen)
        self.key_pos.masked_fill_(~plan.kept, -1)

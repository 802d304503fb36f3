"""Sequence state: the one record of what a batch has seen, shared by every cache layer of a `Cache`.

`seen` [B] counts each row's real tokens (left padding excluded); `columns` counts the block columns fed (padding
included, the same for every row). A block is fed in three steps: `begin` validates its mask and computes the
positions of its tokens once; the cache layers read them (`seq.block`) and stage their writes; `commit` advances
the sequence (or `abort` drops the block). Positions are absolute per row, so no caller ever passes them.

A block belongs to the thread that opened it: `seq.block` read from any other thread raises `CacheThreadError`, so
another thread can neither stage writes into it nor commit or abort it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError, CacheThreadError
from hybridcache.cache.core.limits import check_fits


def check_valid_mask(valid: Any, batch: int, tokens: int, seen: torch.Tensor, owner: str) -> torch.Tensor:
    """Validate a block's real-token mask [B, T] (None = all real) and return it as a bool tensor.

    One rule everywhere: bool, or an integer tensor of 0/1. Left padding only: a row's padding comes before its
    first real token, so a row that already holds real tokens cannot get padding.
    """
    if valid is None:  # every token real: nothing to check (and no data-dependent branch for torch.compile)
        return torch.ones(batch, tokens, dtype=torch.bool, device=seen.device)
    if not isinstance(valid, torch.Tensor):
        raise CacheError(f"{owner}: the attention mask must be a tensor [B, T], got {type(valid).__name__}")
    if valid.is_meta:
        raise CacheError(f"{owner}: the attention mask is on the meta device (a shape without values)")
    if valid.shape != (batch, tokens):
        raise CacheError(f"{owner}: the attention mask has shape {tuple(valid.shape)}, expected {(batch, tokens)}")
    if valid.dtype != torch.bool:
        if valid.dtype.is_floating_point or valid.dtype.is_complex:
            raise CacheError(f"{owner}: the attention mask must be bool or an integer tensor of 0/1, got {valid.dtype}")
        bad = (valid != 0) & (valid != 1)
        if bool(bad.any()):
            value = valid[bad][0].item()
            raise CacheError(f"{owner}: the attention mask must hold only 0 and 1, got {value}")
        valid = valid != 0
    valid = valid.to(seen.device)
    if tokens > 1 and bool((valid[:, 1:] < valid[:, :-1]).any()):
        row = int((valid[:, 1:] < valid[:, :-1]).any(1).nonzero()[0])
        raise CacheError(f"{owner}: row {row} has a padding token after a real token; only left padding is supported")
    started = seen > 0
    if bool((started & ~valid.all(1)).any()):
        row = int((started & ~valid.all(1)).nonzero()[0])
        raise CacheError(
            f"{owner}: row {row} already holds {int(seen[row])} real tokens, so this block cannot contain padding "
            "(left padding comes before a row's first real token)"
        )
    return valid


MAX_POSITION = 2**62  # positions are int64; a block never takes a row past this
_FP_MOD = 2_147_483_647  # 2^31 - 1: products of two residues fit in int64


def token_fingerprint(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row fingerprint [B] of real tokens (positions >= 0), additive over blocks and blind to padding.

    sum of (id + 1) * w(position) mod 2^31-1 with a scrambled weight per position: feeding a sequence in any
    split gives the same value, and a different token at any position changes it (up to ~1e-9 chance).
    """
    return _fingerprint_terms(ids, positions).sum(1) % _FP_MOD


def _fingerprint_terms(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's term [B, T] of the fingerprint (0 for padding)."""
    w = (positions.clamp(min=0) * 2_654_435_761 + 97_531) % _FP_MOD
    terms = ((ids.long() + 1) % _FP_MOD) * w % _FP_MOD
    return torch.where(positions >= 0, terms, 0)


@dataclass
class BlockState:
    """The block being fed: which tokens are real and their positions, computed once for every cache layer."""

    valid: torch.Tensor  # [B, T] bool
    positions: torch.Tensor  # [B, T] long, -1 for padding
    seen_after: torch.Tensor  # [B] real tokens per row once this block is committed
    all_real: bool  # no padding in this block: lets layers and mixers skip masking work
    ids: torch.Tensor | None = None  # [B, T] token ids, when the feeder knows them (for the fingerprint)
    # Values derived from the block that every layer of a kind would recompute (rotary cos/sin per frequency
    # table): computed by the first layer that needs them, read by the others. Dropped with the block.
    memo: dict = field(default_factory=dict)
    thread: int = field(default_factory=threading.get_ident)  # the thread that opened it (the only one it serves)

    @property
    def tokens(self) -> int:
        return self.valid.shape[1]

    @property
    def most_seen_after(self) -> int:
        """max(seen_after), once per block (what eviction checks use to skip work that cannot evict anything)."""
        value = self.memo.get("most_seen_after")
        if value is None:
            value = self.memo["most_seen_after"] = int(self.seen_after.max()) if self.seen_after.numel() else 0
        return value

    @property
    def rope_positions(self) -> torch.Tensor:
        """Positions for rotary embeddings ([B, T]; padding gets 0, it is never attended to)."""
        if self.all_real:  # no padding: nothing to clamp
            return self.positions
        return self.positions.clamp(min=0)

    def mask_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Zero the padding tokens of x [B, T, ...] so they leave recurrent states untouched."""
        if self.all_real:
            return x
        return x * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)


class SequenceState:
    """Per-row real-token counts and the column count of one batch; at most one block open at a time."""

    def __init__(self, batch_size: int, device: torch.device) -> None:
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.columns = 0
        self._block: BlockState | None = None
        self.fingerprint: torch.Tensor | None = torch.zeros_like(self.seen)  # [B]; None once unknown
        # The running fingerprint after each column ([B, capacity], the first `_history_columns` used): what
        # `crop(n)` keeps the fingerprint of the first n columns by, so a cropped cache still knows its tokens.
        self._history: torch.Tensor | None = None
        self._history_columns = 0

    @property
    def batch_size(self) -> int:
        return int(self.seen.shape[0])

    @property
    def block(self) -> BlockState | None:
        """The open block (None: none open). Only the thread that opened it may use it: from any other thread this
        raises `CacheThreadError` (so nothing is staged into, committed from or aborted from another's block)."""
        block = self._block
        if block is not None and not torch.compiler.is_compiling() and block.thread != threading.get_ident():
            raise CacheThreadError(
                f"a block of this cache is open in thread {thread_name(block.thread)}; thread "
                f"{thread_name(threading.get_ident())} cannot feed, commit or abort it (a block belongs to the thread "
                "that opened it: give each thread its own cache, or hand the cache over once the block is closed)"
            )
        return block

    @block.setter
    def block(self, block: BlockState | None) -> None:
        self._block = block

    def make_block(
        self, valid: Any, tokens: int, owner: str, check: bool = True, ids: torch.Tensor | None = None
    ) -> BlockState:
        """Validate a block (mask [B, T] or None = all real) and compute its positions; changes nothing."""
        if self.block is not None:
            raise CacheError(f"{owner}: a block is already being fed; finish it (commit or abort) first")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise CacheError(f"{owner}: a block needs at least one token, got {tokens!r}")
        if tokens >= MAX_POSITION - self.columns:  # seen <= columns: no device sync
            raise CacheError(f"{owner}: a block of {tokens} tokens would take positions past {MAX_POSITION} (int64)")
        # its mask, positions and running sums ([B, T] bool + 2 x int64) before anything is allocated
        check_fits(self.batch_size * tokens * 17, self.seen.device, f"{owner}: a block of {tokens} tokens")
        all_real = valid is None
        if check or not all_real:
            valid = check_valid_mask(valid, self.batch_size, tokens, self.seen, owner)
        else:  # the compiled decode step: every token real, nothing to check
            valid = torch.ones(self.batch_size, tokens, dtype=torch.bool, device=self.seen.device)
        if all_real:
            steps = torch.arange(tokens, device=self.seen.device)
            positions = self.seen[:, None] + steps[None, :]
            seen_after = self.seen + tokens
        else:
            positions = torch.where(valid, self.seen[:, None] + valid.long().cumsum(1) - 1, -1)
            seen_after = self.seen + valid.sum(1)
        return BlockState(valid, positions, seen_after, all_real, ids)

    def commit(self) -> None:
        block = self.block
        if self.fingerprint is not None and block.ids is not None:
            running = (self.fingerprint[:, None] + _fingerprint_terms(block.ids, block.positions).cumsum(1)) % _FP_MOD
            self._append_history(running)
            self.fingerprint = running[:, -1]
        else:  # fed without token ids (a block fed by hand): what the cache saw is no longer known
            self.fingerprint, self._history = None, None
        self.seen, self.columns, self.block = block.seen_after, self.columns + block.tokens, None

    # -- the token fingerprint's history (crop keeps the fingerprint of the columns it keeps) ------------------
    def _history_valid(self) -> bool:
        h = self._history
        return (
            self.fingerprint is not None
            and h is not None
            and self._history_columns == self.columns
            and h.shape[0] == self.batch_size
        )

    def _append_history(self, running: torch.Tensor) -> None:
        """Record the running fingerprint [B, T] of a block being committed (amortized: capacity doubles)."""
        if self.columns == 0:
            self._history, self._history_columns = None, 0
        elif not self._history_valid():
            self._history = None
            return
        used, need = self._history_columns, self._history_columns + running.shape[1]
        h = self._history
        if h is None or h.shape[1] < need:
            grown = running.new_zeros(running.shape[0], max(need, 2 * (0 if h is None else h.shape[1]), 16))
            if h is not None:
                grown[:, :used] = h[:, :used]
            h = grown
        h[:, used:need] = running
        self._history, self._history_columns = h, need

    def fingerprint_at(self, n: int) -> torch.Tensor | None:
        """The fingerprint [B] of the first n columns, or None when it is not known."""
        if n == self.columns:
            return None if self.fingerprint is None else self.fingerprint.clone()
        if n == 0:
            return torch.zeros_like(self.seen)
        if not self._history_valid() or not 0 < n < self.columns:
            return None
        return self._history[:, n - 1].clone()

    def history(self) -> torch.Tensor | None:
        """A copy of the per-column running fingerprint [B, columns] (None when unknown), for snapshots."""
        return self._history[:, : self.columns].clone() if self._history_valid() else None

    def set_tokens(self, fingerprint: torch.Tensor | None, history: torch.Tensor | None = None) -> None:
        """Replace what the sequence knows of its tokens (restore, crop, reset, row operations)."""
        self.fingerprint = fingerprint
        ok = fingerprint is not None and history is not None and tuple(history.shape) == (self.batch_size, self.columns)
        self._history = history.clone() if ok else None
        self._history_columns = self.columns if ok else 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Rows `index` of the per-row records (seen, fingerprint and its history)."""
        history = self.history()
        self.seen = self.seen.index_select(0, index)
        fp = None if self.fingerprint is None else self.fingerprint.index_select(0, index)
        self.set_tokens(fp, None if history is None else history.index_select(0, index))

    def crop(self, n: int, seen: torch.Tensor) -> None:
        """Keep the first n columns (`seen`: real tokens per row after the crop); the fingerprint follows."""
        fp, history = self.fingerprint_at(n), self.history()
        self.seen, self.columns = seen, n
        self.set_tokens(fp, None if history is None else history[:, :n])

    def reset(self) -> None:
        self.seen, self.columns = torch.zeros_like(self.seen), 0
        self.set_tokens(torch.zeros_like(self.seen))


def thread_name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return f"{t.name!r} ({ident})"
    return f"{ident} (no longer running)"


def check_crop_length(n: Any, columns: int, owner: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheError(f"{owner}: crop length must be an int, got {n!r}")
    if n < 0:
        raise CacheError(f"{owner}: crop length must be >= 0, got {n}")
    if n > columns:
        raise CacheError(f"{owner}: cannot crop to {n} tokens, it holds a sequence of only {columns}")
    return n


def crop_seen(seq: SequenceState, n: int) -> torch.Tensor:
    """Real tokens per row [B] after keeping the first n columns (left padding comes first)."""
    return (seq.seen - (seq.columns - n)).clamp(min=0)

"""`Cache`: the cache layers of one model and batch, the one owner of their sequence state.

Per decoder layer the cache holds one cache layer or a `CacheGroup` of named members. Every layer reads the same
`SequenceState` (real tokens per row, columns, the open block), so layers can never disagree about what was seen.
A block is a transaction: `begin_block` validates the mask and every layer's capacity and computes positions once;
the model's mixers feed their layers (writes are staged); `end_block` commits every layer and the sequence, or
`abort_block` drops the block. Every other operation validates every layer before it changes any.

Threading: a Cache is not shared between threads. Using one from two threads at once raises `CacheThreadError`
instead of corrupting it (one operation at a time holds the cache's lock; a block holds it from begin to end, and
belongs to the thread that opened it: another thread can neither feed, commit nor abort it). A call made of many
operations (`generate`, beam search, speculative decoding) claims the cache for its thread from start to end
(`claimed()`), so another thread cannot reset, crop or feed it between two decode steps either.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hybridcache.cache.core import decode_feed
from hybridcache.cache.core.base import CacheLayer, check_positive_int
from hybridcache.cache.core.errors import CacheError, CacheIndexError, CacheIndexTypeError, CacheThreadError
from hybridcache.cache.core.group import CacheGroup, Entry
from hybridcache.cache.core.limits import check_new_cache, check_rows_fit, device_problem
from hybridcache.cache.core.plan import CachePlan, Native, resolve_plan
from hybridcache.cache.core.registry import get_layer_class
from hybridcache.cache.core.sequence import BlockState, SequenceState, check_crop_length, crop_seen, thread_name
from hybridcache.cache.core.snapshot import CacheSnapshot, check_cache_snapshot
from hybridcache.cache.core.snapshot_check import check_snapshot_shapes
from hybridcache.cache.io import persistence
from hybridcache.cache.io.model_identity import model_identity

__all__ = ["Cache", "CacheGroup", "CacheSnapshot", "Entry"]


class Cache:
    """The cache layers of a model (one entry per decoder layer) sharing one batch and one sequence state."""

    def __init__(self, entries: Sequence[CacheLayer | Mapping[str, CacheLayer]], plan: CachePlan | None = None) -> None:
        entries = [CacheGroup(e) if isinstance(e, Mapping) and not isinstance(e, CacheGroup) else e for e in entries]
        if not entries:
            raise CacheError("a Cache needs at least one cache layer")
        layers: list[CacheLayer] = []
        for i, entry in enumerate(entries):
            for layer in entry.values() if isinstance(entry, CacheGroup) else (entry,):
                if not isinstance(layer, CacheLayer):
                    raise CacheError(f"Cache entry {i} holds a {type(layer).__name__}, not a CacheLayer")
                layers.append(layer)
        if len({id(layer) for layer in layers}) != len(layers):
            raise CacheError("the same cache layer object appears twice in a Cache")
        first = layers[0].seq
        for layer in layers:  # adopt the layers: they must agree on what was seen, then share one state
            s = layer.seq
            if s.block is not None:
                raise CacheError(f"{layer.name} is in the middle of a block")
            if s.batch_size != first.batch_size or s.columns != first.columns or not torch.equal(s.seen, first.seen):
                raise CacheError("cache layers disagree on the batch or on what was seen; build them together")
        self.seq = SequenceState(first.batch_size, first.seen.device)
        self.seq.seen, self.seq.columns = first.seen.clone(), first.columns
        if first.columns:  # layers fed on their own: which tokens they saw is not known
            self.seq.set_tokens(None)
        for i, layer in enumerate(layers):  # cache_index keys a layer's stochastic rounding (state_layout.py)
            layer.seq, layer.standalone, layer.cache_index = self.seq, False, i
        self.entries, self.layers, self.plan = entries, layers, plan
        self._lock, self._holder = threading.Lock(), None
        self._claim: int | None = None  # the thread that claimed the cache for a whole call (claimed())
        self.owner: weakref.ref | None = None  # the model that last fed it (what `save` records the identity of)
        self._reserved: int | None = None  # the tokens a reserve_decode holds the cache for

    def __getstate__(self) -> dict[str, Any]:  # copy / deepcopy / pickle: a fresh lock, not the held one
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_holder"], state["_reserved"], state["_claim"], state["owner"] = None, None, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def from_plan(cls, plan: CachePlan, batch_size: int, device: torch.device | str | None = None) -> Cache:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise CacheError(f"Cache: batch_size must be a positive integer, got {batch_size!r}")
        check_new_cache(plan, batch_size, device if device is not None else "cpu")
        seq = SequenceState(batch_size, torch.device(device if device is not None else "cpu"))
        entries: list[Any] = []
        for p in plan.layers:
            layer = get_layer_class(p.type)(p.spec, batch_size, device, sequence=seq)
            if p.member is None:
                entries.append(layer)
            elif p.index == len(entries):
                entries.append({p.member: layer})
            else:
                entries[p.index][p.member] = layer
        return cls(entries, plan)

    @classmethod
    def build(
        cls,
        native: Sequence[Native],
        batch_size: int,
        cache_config: Mapping[str, Any] | None = None,
        max_length: int | None = None,
        device: torch.device | str | None = None,
    ) -> Cache:
        """Resolve `cache_config` against the model's native layers and allocate the cache."""
        return cls.from_plan(resolve_plan(native, cache_config, max_length), batch_size, device)

    # -- sequence ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, key: int | slice) -> Entry | list[Entry]:
        """Entry i (decoder layer i; negative counts from the end), or a list of entries for a slice."""
        n = len(self.entries)
        if isinstance(key, slice):
            return self.entries[key]
        try:
            bool_tensor = isinstance(key, torch.Tensor) and key.dtype == torch.bool  # a mask, not a position
            i = None if isinstance(key, bool) or bool_tensor else operator.index(key)  # ints, numpy ints, int tensors
        except TypeError:
            i = None
        if i is None:
            raise CacheIndexTypeError(
                f"a Cache is indexed by decoder layer: an int in [-{n}, {n}) or a slice; got "
                f"{key!r} ({type(key).__name__}); this cache has {n} layers"
            )
        if not -n <= i < n:
            raise CacheIndexError(
                f"cache layer index {i} is out of range: this cache has {n} layers (indices 0 to "
                f"{n - 1}, or -{n} to -1 from the end)"
            )
        return self.entries[i]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __repr__(self) -> str:
        def describe(e: Entry) -> str:
            if isinstance(e, CacheGroup):
                return "{" + ", ".join(f"{k}: {v.type_name}" for k, v in e.items()) + "}"
            return e.type_name

        return (
            f"Cache([{', '.join(describe(e) for e in self.entries)}]; batch={self.batch_size}, columns={self.columns})"
        )

    @property
    def batch_size(self) -> int:
        return self.seq.batch_size

    @property
    def device(self) -> torch.device:
        return self.seq.seen.device

    @property
    def seen(self) -> torch.Tensor:
        """Real tokens seen per row [B] (left padding excluded)."""
        return self.seq.seen.clone()

    @property
    def columns(self) -> int:
        """Length of the sequence fed so far, padding included."""
        return self.seq.columns

    @property
    def is_exact(self) -> bool:
        """Whether every layer, as configured, is exact (cached == recompute with the same patterns)."""
        return all(layer.is_exact for layer in self.layers)

    @property
    def current_block(self) -> BlockState:
        block = self.seq.block
        if block is None:
            raise CacheError("no block is open: feed the cache through the model or `with cache.block(mask):`")
        return block

    # -- feeding a block ---------------------------------------------------------------------------------------
    def _acquire(self, what: str) -> None:
        me = threading.get_ident()
        if not self._lock.acquire(blocking=False):
            if self._holder == me:  # this thread is feeding a block
                raise CacheError(f"Cache.{what}: a block is being fed; finish it (commit or abort) first")
            if self._claim == me:
                # this thread's claim (only it sets or clears it, so the read is safe): the lock's holder is another
                # thread between its acquire and its refusal, which lets go at once
                self._lock.acquire()
                self._holder = me
                return
            raise CacheThreadError(
                f"Cache.{what}: the cache is in use by another thread (a Cache belongs to one thread "
                "at a time; give each thread its own cache, or hand it over when one is done)"
            )
        if self._claim is not None and self._claim != me:  # set and cleared under the lock: no race with this read
            self._lock.release()
            raise CacheThreadError(
                f"Cache.{what}: the cache is claimed by a call running in thread {thread_name(self._claim)} "
                "(generate, beam search); it belongs to that thread until the call returns"
            )
        self._holder = me

    @contextmanager
    def claimed(self) -> Iterator[None]:
        """Claim this cache for the calling thread for a whole call made of many operations (what `generate` does):
        until the block exits, any feed or operation from another thread raises `CacheThreadError`. Re-entrant."""
        self._acquire("claim")
        outer, self._claim = self._claim, threading.get_ident()
        self._release()
        try:
            yield
        finally:
            self._lock.acquire()  # uncontended unless another thread is between its acquire and its refusal
            self._claim = outer
            self._lock.release()

    def _release(self) -> None:
        self._holder = None
        self._lock.release()

    def begin_block(
        self,
        valid: torch.Tensor | None = None,
        tokens: int | None = None,
        check: bool = True,
        ids: torch.Tensor | None = None,
    ) -> BlockState:
        """Open a block of `tokens` columns (`valid` [B, T]: real tokens; None = all real). Validates the mask and
        every layer's capacity before anything changes; `check=False` skips the mask work (all-real decode).
        `ids` [B, T], when known, keep the cache's token fingerprint (what generation checks continuations by)."""
        if isinstance(valid, torch.Tensor) and valid.dim() == 2:
            if tokens is not None and tokens != valid.shape[1]:
                raise CacheError(
                    f"Cache: the attention mask has shape {tuple(valid.shape)}, expected ({self.batch_size}, {tokens})"
                )
            tokens = valid.shape[1]
        self._acquire("begin_block")
        try:
            block = self.seq.make_block(valid, tokens, "Cache", check=check, ids=ids)
            for layer in self.layers:
                layer.check_block(block)
        except BaseException:
            self._release()
            raise
        self.seq.block = block
        return block

    def end_block(self) -> None:
        """Commit the open block in every layer; every layer must have been fed (else nothing is committed)."""
        self.current_block  # noqa: B018 - raises when no block is open
        missing = [i for i, layer in enumerate(self.layers) if not layer.fed]
        if missing:
            self.abort_block()
            raise CacheError(f"cache layers {missing} were not fed in this block; the block was dropped")
        for layer in self.layers:
            layer.commit_block()
        self.seq.commit()
        self._release()

    def abort_block(self) -> None:
        """Drop the open block: every layer keeps what it held before it."""
        if self.seq.block is None:
            return
        for layer in self.layers:
            layer.abort_block()
        self.seq.block = None
        self._release()

    # -- a decode that feeds its tokens after running them (decode_feed.py, accel/runs/decode_run.py) ---------------
    def reserve_decode(self, tokens: int) -> list[Any] | None:
        """Hold this cache, with room for `tokens` decode tokens the caller writes itself and then feeds by
        `feed_reserved` (None: not held, a layer cannot); decode_feed.reserve_decode."""
        return decode_feed.reserve_decode(self, tokens)

    def feed_reserved(self, ids: torch.Tensor | None) -> None:
        """End a `reserve_decode`: feed `ids` [B, n], whose keys and values the caller wrote into the first n
        reserved slots, as one block (None: nothing), and let go of the cache. See decode_feed.feed_reserved."""
        decode_feed.feed_reserved(self, ids)

    @contextmanager
    def block(self, valid: torch.Tensor | None = None, tokens: int | None = None) -> Iterator[BlockState]:
        """`with cache.block(mask) as b:` feed every layer once (`layer.update(...)`); commits on success."""
        block = self.begin_block(valid, tokens)
        try:
            yield block
        except BaseException:
            self.abort_block()
            raise
        self.end_block()

    # -- atomic whole-cache operations -------------------------------------------------------------------------
    @contextmanager
    def _operation(self, what: str):
        self._acquire(what)
        try:
            if self.seq.block is not None:
                raise CacheError(f"Cache.{what}: a block is being fed")
            yield
        finally:
            self._release()

    def reset(self) -> None:
        with self._operation("reset"):
            for layer in self.layers:
                layer._commit_reset()
            self.seq.reset()

    def check_capacity(self, seen_after: torch.Tensor) -> None:
        """Raise if preallocated layers cannot hold `seen_after` [B] real tokens per row (changes nothing)."""
        for layer in self.layers:
            layer.check_capacity(seen_after)

    def _index(self, what: str, plans: list[torch.Tensor] | None, index: torch.Tensor) -> None:
        for layer, plan in zip(self.layers, plans or [index] * len(self.layers)):
            layer._commit_index(plan)
        self.seq.select_rows(index)

    def reorder(self, index: Any) -> None:
        """Row i becomes old row index[i] in every layer (beam search)."""
        with self._operation("reorder"):
            plans = [layer._prepare_index(index, same_size=True) for layer in self.layers]
            self._index("reorder", plans, plans[0])

    def select(self, index: Any) -> None:
        """Keep rows `index` (the batch size may change)."""
        with self._operation("select"):
            plans = [layer._prepare_index(index, same_size=False) for layer in self.layers]
            if len(plans[0]) > self.batch_size:
                check_rows_fit(self, len(plans[0]), "select")
            self._index("select", plans, plans[0])

    def repeat(self, n: int) -> None:
        """Repeat each row n times ([a, b] -> [a, a, b, b]), e.g. for several samples per prompt."""
        with self._operation("repeat"):
            check_positive_int("Cache", "repeat count", n)
            check_rows_fit(self, self.batch_size * n, "repeat")
            index = self.layers[0]._prepare_repeat(n)
            self._index("repeat", None, index)

    def crop(self, n: int) -> None:
        """Truncate every layer to the first n columns; raises (changing nothing) if a layer cannot."""
        with self._operation("crop"):
            n = check_crop_length(n, self.columns, "Cache")
            seen = crop_seen(self.seq, n)
            plans = [layer._prepare_crop(n, seen) for layer in self.layers]
            for layer, plan in zip(self.layers, plans):
                layer._commit_crop(plan)
            self.seq.crop(n, seen)  # the token fingerprint of the first n columns is kept

    def snapshot(self) -> CacheSnapshot:
        with self._operation("snapshot"):
            fp = None if self.seq.fingerprint is None else self.seq.fingerprint.clone()
            return CacheSnapshot(
                tuple(layer.snapshot() for layer in self.layers),
                self.seq.seen.clone(),
                self.columns,
                fp,
                self.seq.history(),
            )

    def restore(self, snap: CacheSnapshot) -> None:
        """Put back a snapshot of this cache (or of one with the same layers; the batch size may differ). Checks
        every layer's tensors (rows, shapes, dtypes) against the snapshot's sequence state first."""
        with self._operation("restore"):
            columns, seen = check_cache_snapshot(snap, len(self.layers))
            plans = [layer._prepare_restore(s) for layer, s in zip(self.layers, snap.layers)]
            for i, (layer, s) in enumerate(zip(self.layers, snap.layers)):
                check_snapshot_shapes(i, layer, s)
            for layer, plan in zip(self.layers, plans):
                layer._commit_restore(plan)
            self.seq.seen, self.seq.columns = seen.clone().to(self.device), columns
            fp = None if snap.fingerprint is None else snap.fingerprint.clone().to(self.device)
            self.seq.set_tokens(fp, None if snap.history is None else snap.history.to(self.device))

    # -- persistence: the file format lives in persistence.py, which knows the cache only through this interface --
    def save(self, path: Any, model: Any = None, *, key: bytes | None = None) -> Any:
        """Write this cache to `path` (safetensors + JSON header + payload sha256; never pickle). `model` is the
        model that filled it (default: the one `generate` last ran with this cache); its identity is recorded so
        the file only loads into the same model."""
        filled_by = self.owner() if self.owner is not None else None
        if model is None:
            model = filled_by
        if model is None:
            raise CacheError("Cache.save: pass model= (the model that filled this cache)")
        if not isinstance(model, torch.nn.Module):
            raise CacheError(f"Cache.save: model must be the model that filled this cache, got {type(model).__name__}")
        if filled_by is not None and model is not filled_by and model_identity(model) != model_identity(filled_by):
            raise CacheError(
                f"Cache.save: this cache was filled by another model (a {type(filled_by).__name__} whose config or "
                f"weights differ from model='s {type(model).__name__}); a saved cache only loads into the model that "
                "filled it: pass that model, or none"
            )
        return persistence.save_cache(self, path, model, key=key)

    @classmethod
    def load(
        cls,
        path: Any,
        model: Any,
        batch_size: int | None = None,
        cache_config: Mapping[str, Any] | None = None,
        device: Any = None,
        *,
        key: bytes | None = None,
    ) -> Cache:
        """Load a saved cache for `model`; a corrupted file, another model, batch size or cache config is a
        `CacheFileError` naming what differs. The round trip is bit-exact (token fingerprint included)."""
        if device is not None:  # before any work: a device that cannot hold the saved values (meta: shapes only)
            problem = device_problem(device)
            if problem is None and torch.device(device).type == "meta":
                problem = f"device {device!r} holds shapes, not the saved values (load onto 'cpu' or a GPU)"
            if problem:
                raise CacheError(f"Cache.load: {problem}")
        saved = persistence.read_saved_cache(path, model, batch_size, cache_config, key=key)
        cache = cls.from_plan(saved.plan, saved.batch_size, device if device is not None else saved.device)
        persistence.fill_saved_cache(cache, saved, model)
        return cache

    # -- memory ------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of keys, values and states actually held."""
        return sum(layer.nbytes() for layer in self.layers)

    def spare_nbytes(self) -> int:
        """Bytes allocated beyond those held: spare slots that dynamic attention layers append into in place."""
        return sum(layer.spare_nbytes() for layer in self.layers)

    def memory_report(self) -> list[dict[str, Any]]:
        """Per cache type: layers, bytes held, theoretical minimum for what the rows have seen, the ratio, and the
        spare bytes allocated beyond the held ones (append_buffer.py)."""
        rows: dict[str, dict[str, Any]] = {}
        for layer in self.layers:
            key = layer.type_name + (" (preallocated)" if getattr(layer, "static", False) else "")
            row = rows.setdefault(key, {"type": key, "layers": 0, "held": 0, "minimum": 0, "spare": 0})
            row["layers"] += 1
            row["held"] += layer.nbytes()
            row["spare"] += layer.spare_nbytes()
            row["minimum"] += layer.min_nbytes()
        for row in rows.values():
            row["ratio"] = (
                row["held"] / row["minimum"] if row["minimum"] else (1.0 if not row["held"] else float("inf"))
            )
        return list(rows.values())

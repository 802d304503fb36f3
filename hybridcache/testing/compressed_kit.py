"""The conformance kit for compressed types (`compressed_kv`; see hybridcache.testing): a compressor fed through the
layer in random splits gives the entries of the same sources fed at once (the kit pools windows itself: a gated
softmax over each window, or over the previous window's first series and this one's second with overlap), its open
window holds the sources since the last closed window, and the batch operations, crop (exact within the open window,
refused cleanly before it), snapshot / restore, accounting and atomic failures keep the contract."""

from __future__ import annotations

import torch

from hybridcache.cache import Cache, CacheCropError, NativeLayer
from hybridcache.testing.kit import _fail, _Kit, _snapshot_equal


def pool(layer, kv: torch.Tensor, gate: torch.Tensor):
    """The kit's mixer: (entries [B, n, D], last window or None) of the windows a block of sources closes."""
    s = layer.spec
    r, d = s.compress_rate, s.entry_dim
    ready_kv, ready_gate, _ = layer.ready(kv, gate)
    b, n, w = ready_kv.shape[0], ready_kv.shape[1] // r, s.source_dim
    w_kv, w_gate = ready_kv.view(b, n, r, w), ready_gate.view(b, n, r, w).to(s.overlap_gate_dtype)  # [B, n, r, W]
    if not s.overlap:
        return (w_kv * w_gate.softmax(2).to(w_kv.dtype)).sum(2), None
    slots_kv = w_kv.new_zeros(b, n, 2 * r, d)
    slots_gate = w_gate.new_full((b, n, 2 * r, d), float("-inf"))
    slots_kv[:, :, r:], slots_gate[:, :, r:] = w_kv[..., d:], w_gate[..., d:]
    slots_kv[:, 1:, :r], slots_gate[:, 1:, :r] = w_kv[:, :-1, :, :d], w_gate[:, :-1, :, :d]
    prior = layer.previous_window()
    if prior is not None and n:
        slots_kv[:, 0, :r], slots_gate[:, 0, :r] = prior
    entries = (slots_kv * slots_gate.softmax(2).to(w_kv.dtype)).sum(2)
    return entries, ((w_kv[:, -1, :, :d], w_gate[:, -1, :, :d]) if n else None)


class _CompressedKit(_Kit):
    def cache(self, batch: int, max_length: int | None = None, dtype=torch.float64) -> Cache:
        return Cache.build([NativeLayer(self.name, {**self.native, "dtype": dtype})], batch, self.params or None)

    def sources(self, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.cache(1)[0].spec.source_dim
        return tuple(torch.randn(batch, tokens, w, generator=self.g, dtype=torch.float64) for _ in range(2))

    def feed(self, cache: Cache, kv: torch.Tensor, gate: torch.Tensor) -> None:
        layer = cache[0]
        with cache.block(None, kv.shape[1]):
            entries, last = pool(layer, kv, gate)
            layer.update(kv, gate, entries, last)

    def run(self, cases: int) -> dict[str, int]:
        for case in range(cases):
            where = f"'{self.name}' case {case}"
            batch, n = self.randint(1, 3), self.randint(1, 14)
            kv, gate = self.sources(batch, n)
            whole, split = self.cache(batch), self.cache(batch)
            self.feed(whole, kv, gate)
            cuts = self.splits(n)
            for a, b in zip(cuts, cuts[1:]):
                self.feed(split, kv[:, a:b], gate[:, a:b])
            layer, r = split[0], split[0].spec.compress_rate
            if not _snapshot_equal(split.snapshot(), whole.snapshot()):
                _fail(where, f"fed in blocks {cuts} it holds other tensors than fed at once")
            if layer.entry_count != n // r or not torch.equal(layer.buffer_kv, kv[:, n // r * r :]):
                _fail(where, f"after {n} sources it holds {layer.entry_count} entries and another open window")
            self.count("split == one-shot")
            if layer.nbytes() != layer.spec.min_nbytes(batch, n) or split.nbytes() != split.plan.held_nbytes(batch, n):
                _fail(where, f"holds {layer.nbytes()} bytes; the spec says {layer.spec.min_nbytes(batch, n)}")
            self.count("accounting")
            snap = split.snapshot()
            more_kv, more_gate = self.sources(batch, self.randint(1, 5))
            self.feed(split, more_kv, more_gate)
            after = split.snapshot()
            split.restore(snap)
            self.feed(split, more_kv, more_gate)
            if not _snapshot_equal(split.snapshot(), after):
                _fail(where, "restore then the same block does not give the same tensors")
            split.restore(snap)
            self.count("snapshot / restore")
            if batch > 1:
                perm = torch.arange(batch).flip(0)
                split.reorder(perm)
                if not torch.equal(layer.entries, whole[0].entries[perm]):
                    _fail(where, "reorder did not move the entries with their rows")
                split.restore(snap)
            self.count("reorder / select / repeat")
            self.check_crop(where, snap, split, kv, gate)
            split.restore(snap)
            self.check_refusals(where, split, kv, gate)
        return self.counts

    def check_refusals(self, where: str, cache: Cache, kv: torch.Tensor, gate: torch.Tensor) -> None:
        layer, n = cache[0], kv.shape[1]
        too_many = torch.zeros(kv.shape[0], n + 1, layer.spec.entry_dim, dtype=kv.dtype)
        for call in (
            lambda: self.feed(cache, kv[..., :-1], gate[..., :-1]),  # wrong width
            lambda: self.feed(cache, kv.float(), gate.float()),  # wrong dtype
            lambda: layer.update(kv, gate, too_many),  # outside a block, and more entries than windows
            lambda: cache.crop(cache.columns + 1),
        ):
            self.expect_refusal(where, cache, call)

    def check_crop(self, where: str, snap, cache: Cache, kv: torch.Tensor, gate: torch.Tensor) -> None:
        n, r = kv.shape[1], cache[0].spec.compress_rate
        cut = self.randint(0, n)
        before = cache.snapshot()
        if cut < n // r * r:
            try:
                cache.crop(cut)
            except CacheCropError:
                if not _snapshot_equal(cache.snapshot(), before):
                    _fail(where, "a refused crop changed the cache")
                self.count("crop (refused cleanly)")
                return
            _fail(where, f"crop({cut}) before the open window (column {n // r * r}) was accepted")
        cache.crop(cut)
        fresh = self.cache(kv.shape[0])
        if cut:
            self.feed(fresh, kv[:, :cut], gate[:, :cut])
        if not _snapshot_equal(cache.snapshot(), fresh.snapshot()):
            _fail(where, f"crop({cut}) does not give what the first {cut} sources give")
        self.count("crop (exact)")

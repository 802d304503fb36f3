"""The conformance kit for attention cache types (see hybridcache.testing)."""

from __future__ import annotations

import math

import torch

from hybridcache.accel.native.op_declarations import PATTERNS
from hybridcache.accel.native.op_reference import visible as kernel_visible
from hybridcache.cache import Cache, CacheCropError, CacheError
from hybridcache.cache.methods.scored_eviction import QueryInputs
from hybridcache.testing.kit import ATTENTION_SHAPES, EXACT_TOL, _fail, _Kit, _snapshot_equal  # noqa: F401


class _AttentionKit(_Kit):
    native_type = "full"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        probe = self.cache(1, None)[0]
        self.spec, self.codec = probe.spec, probe.spec.codec()
        self.bound = getattr(self.codec, "output_error_bound", None)
        self.lossless = probe.spec.lossless_tokens() if hasattr(probe.spec, "lossless_tokens") else None

    def data(self, batch: int, n: int) -> tuple[torch.Tensor, ...]:
        h, d = self.native["num_kv_heads"], self.native["head_dim"]
        return tuple(torch.randn(batch, h, n, d, generator=self.g, dtype=torch.float64) for _ in range(3))

    def oracle(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """Naive whole-sequence attention with the spec's pattern over real positions."""
        pos = torch.where(mask, mask.long().cumsum(1) - 1, -1)  # [B, N]
        qp, kp = pos[:, :, None], pos[:, None, :]
        visible = (qp >= 0) & (kp >= 0) & self.spec.visible(qp, kp)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0)
        return probs @ v

    def feed(self, cache: Cache, q, k, v, mask, bounds) -> torch.Tensor:
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            block_mask = mask[:, a:b]
            with cache.block(None if bool(block_mask.all()) else block_mask, b - a):
                view = cache[0].update(k[:, :, a:b], v[:, :, a:b])
                scores = (q[:, :, a:b] @ view.keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
                vis = view.mask if view.mask.dim() == 4 else view.mask[:, None]  # per-head positions: [B, H, T, S]
                probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
                if getattr(cache[0], "wants_queries", False):  # no rotary here: the queries are pre-rotary
                    cache[0].observe_attention(probs, QueryInputs(q[:, :, a:b], None, 1 / math.sqrt(q.shape[-1])))
                elif cache[0].wants_attention_weights:
                    cache[0].observe_attention(probs)
            outs.append(probs @ view.values)
        return torch.cat(outs, dim=2)

    def compare(self, where: str, got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, n_seen: int) -> None:
        real = mask[:, None, :, None].expand_as(got)
        err = (got - want).abs()[real].max().item() if real.any() else 0.0
        if not math.isfinite(err):
            _fail(where, "non-finite attention output")
        pattern_kept = self.cls.exact or (self.lossless is not None and n_seen <= self.lossless)
        if pattern_kept and self.codec.exact and err > EXACT_TOL:
            _fail(where, f"cached attention differs from the pattern's whole-sequence attention by {err:.2e}")
        if pattern_kept and not self.codec.exact and self.bound is not None and err > self.bound:
            _fail(where, f"lossy storage error {err:.3e} exceeds the documented bound {self.bound}")
        # past `lossless_tokens` a score-based pattern has no numeric bound: only finiteness is checked

    def run(self, cases: int) -> dict[str, int]:
        layouts: tuple[int | None, ...] = (None, 40)
        if not self.cls.supports_preallocation or not getattr(self.codec, "preallocates", True):  # say so clearly
            try:
                self.cache(1, 40)
            except CacheError:
                layouts = (None,)
                self.count("refuses preallocation clearly")
            else:
                _fail(f"'{self.name}'", "declares no preallocation (type or storage) but accepted max_length")
        self.declared_form()
        for case in range(cases):
            for max_length in layouts:
                where = f"'{self.name}' {self.params} {'preallocated' if max_length else 'dynamic'} case {case}"
                self.split_equals_one_shot(where, max_length)
                self.crop(where, max_length)
                self.snapshot_and_rows(where, max_length)
                self.failures(where, max_length)
        return self.counts

    def declared_form(self) -> None:
        """The form a spec declares for the decode kernels (`kernel_pattern`) must be its `visible`: the kernels
        evaluate that form from positions instead of asking the spec (every pair of positions below 96)."""
        form = self.spec.kernel_pattern()
        if form is None:
            return
        where = f"'{self.name}' {self.params}"
        if not (isinstance(form, tuple) and len(form) == 2 and form[0] in PATTERNS and isinstance(form[1], int)):
            _fail(where, f"kernel_pattern() must be (one of {', '.join(PATTERNS)}, an int) or None, got {form!r}")
        q = torch.arange(96).view(-1, 1)
        kv = q.view(1, -1).expand(96, -1)
        if not torch.equal(kernel_visible(q, kv, *form), self.spec.visible(q, kv)):
            _fail(where, f"declares the kernel form {form}, which differs from its visible pattern")
        self.count("kernel form == visible")

    def split_equals_one_shot(self, where: str, max_length: int | None) -> None:
        batch, n = self.randint(1, 3), self.randint(1, 30)
        q, k, v = self.data(batch, n)
        mask = self.pads_mask(batch, n)
        cache = self.cache(batch, max_length)
        got = self.feed(cache, q, k, v, mask, self.splits(n))
        self.compare(f"{where} split", got, self.oracle(q, k, v, mask), mask, n)
        self.count("split == one-shot")
        layer, seen = cache[0], int(mask.sum(1).max())
        if max_length is not None:
            if cache.nbytes() != cache.plan.held_nbytes(batch, seen):
                _fail(where, f"holds {cache.nbytes()} bytes, the plan says {cache.plan.held_nbytes(batch, seen)}")
        elif bool(mask.all()) and layer.nbytes() > self.held_limit(layer, batch, seen):
            _fail(
                where,
                f"holds {layer.nbytes()} bytes, more than the {self.held_limit(layer, batch, seen)} its pattern needs",
            )
        self.count("held <= needed")

    def held_limit(self, layer, batch: int, seen: int) -> int:
        """What an unpadded layer may hold: its minimum, or for a layer-level storage whose bytes depend on the split
        (hf_quantized's dense buffer) the spec's `max_nbytes`."""
        return layer.spec.max_nbytes(batch, seen) if getattr(self.codec, "grouped", False) else layer.min_nbytes()

    def crop(self, where: str, max_length: int | None) -> None:
        batch, n, extra = 2, self.randint(2, 24), self.randint(1, 6)
        q, k, v = self.data(batch, n + extra)
        mask = self.pads_mask(batch, n + extra)
        mask[:, n:] = True
        cache = self.cache(batch, max_length)
        self.feed(cache, q, k, v, mask, self.splits(n))
        cut = self.randint(0, n)
        before = cache.snapshot()
        try:
            cache.crop(cut)
        except CacheCropError:
            if not _snapshot_equal(cache.snapshot(), before):
                _fail(where, f"a refused crop({cut}) changed the cache")
            self.count("crop (refused cleanly)")
            return
        sub = torch.cat([mask[:, :cut], mask[:, n:]], 1)
        cols = [*range(cut), *range(n, n + extra)]
        qs, ks, vs = q[:, :, cols], k[:, :, cols], v[:, :, cols]
        if not bool(sub.any(1).all()):
            return
        got = self.feed(cache, qs[:, :, cut:], ks[:, :, cut:], vs[:, :, cut:], sub[:, cut:], [0, extra])
        want = self.oracle(qs, ks, vs, sub)[:, :, cut:]
        self.compare(f"{where} crop({cut})", got, want, sub[:, cut:], int(sub.sum(1).max()))
        self.count("crop (exact)")

    def snapshot_and_rows(self, where: str, max_length: int | None) -> None:
        batch, n = 3, self.randint(2, 20)
        q, k, v = self.data(batch, n + 2)
        mask = self.pads_mask(batch, n + 2)
        mask[:, n:] = True
        cache = self.cache(batch, max_length)
        self.feed(cache, q, k, v, mask, self.splits(n))
        snap = cache.snapshot()
        first = self.feed(cache, q[:, :, n:], k[:, :, n:], v[:, :, n:], mask[:, n:], [0, 1, 2])
        after = cache.snapshot()
        cache.restore(snap)
        if not _snapshot_equal(cache.snapshot(), snap):
            _fail(where, "restore is not bit-exact")
        again = self.feed(cache, q[:, :, n:], k[:, :, n:], v[:, :, n:], mask[:, n:], [0, 1, 2])
        if not torch.equal(first, again) or not _snapshot_equal(cache.snapshot(), after):
            _fail(where, "the same continuation after restore gave a different result")
        self.count("snapshot / restore")
        cache.restore(snap)
        perm = torch.tensor([2, 0, 1])
        cache.reorder(perm)
        got = self.feed(cache, q[perm][:, :, n:], k[perm][:, :, n:], v[perm][:, :, n:], mask[perm][:, n:], [0, 1, 2])
        if (got - first[perm]).abs().max().item() > EXACT_TOL:
            _fail(where, "after reorder, rows did not continue with their own history")
        cache.restore(snap)
        cache.select(torch.tensor([1]))
        cache.repeat(2)
        got = self.feed(
            cache, q[[1, 1]][:, :, n:], k[[1, 1]][:, :, n:], v[[1, 1]][:, :, n:], mask[[1, 1]][:, n:], [0, 1, 2]
        )
        if (got - first[[1, 1]]).abs().max().item() > EXACT_TOL:
            _fail(where, "after select + repeat, rows did not continue with their own history")
        self.count("reorder / select / repeat")

    def failures(self, where: str, max_length: int | None) -> None:
        cache = self.cache(2, max_length)
        q, k, v = self.data(2, 3)
        self.feed(cache, q, k, v, torch.ones(2, 3, dtype=torch.bool), [0, 3])
        layer = cache[0]
        bad = k[:, :, :1, :-1]  # wrong head_dim

        def wrong_shape():
            with cache.block(None, 1):
                layer.update(bad, bad)

        def wrong_dtype():
            with cache.block(None, 1):
                layer.update(k[:, :, :1].float(), v[:, :, :1].float())

        def unfed():
            with cache.block(None, 1):
                pass

        for call in (
            wrong_shape,
            wrong_dtype,
            unfed,
            lambda: layer.update(k[:, :, :1], v[:, :, :1]),
            lambda: cache.crop(99),
            lambda: cache.reorder([0, 5]),
        ):
            self.expect_refusal(where, cache, call)
        if max_length is not None:
            self.expect_refusal(
                where, cache, lambda: self.feed(cache, *self.data(2, 50), torch.ones(2, 50, dtype=torch.bool), [0, 50])
            )

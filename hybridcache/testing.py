"""The conformance kit: `check_cache_type("name")` checks a registered cache type against the cache-layer contract.

It is what the test suite runs over every registered type (and every attention type with every storage format),
so a new type gets its tests for free:

    from hybridcache.testing import check_cache_type
    check_cache_type("sink")                       # example parameters from the class
    check_cache_type("sliding", params={"window": 3, "storage": "int8"})

Checks (each on dynamic and preallocated storage, on left-padded batches, with seeded random data):
- split == one-shot: attention outputs for every split equal a naive whole-sequence attention with the spec's own
  pattern (`visible`), to 1e-9 in float64; lossy types stay within their documented bound instead;
- held <= needed: dynamic storage holds what the next query can see (`min_nbytes`), preallocated storage what the
  spec says it allocates (`held_nbytes`);
- crop: either exact (continuing after crop(n) equals continuing after the first n columns) or a CacheCropError that
  changes nothing;
- snapshot / restore: bit-exact, and the same continuation gives the same result again;
- reorder / select / repeat: rows move with their history;
- atomic failures: bad calls raise CacheError and leave the whole cache unchanged;
- memory accounting: `Cache.nbytes()` agrees with the plan's `held_nbytes` for preallocated storage.
Recurrent types get the checks that apply to states (shapes and dtypes from the spec, staging, batch operations,
snapshot, crop refusal or exactness, atomic failures, accounting); a lossy `state_codec` must give back exactly its
own round trip of what it was handed (`layer.round_trip`), checkpoints and batch operations included.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from hybridcache.cache import Cache, CacheCropError, CacheError, NativeLayer, get_layer_class
from hybridcache.cache.kv_codecs import available_codecs, codec_class
from hybridcache.cache.scored_eviction import QueryInputs

ATTENTION_SHAPES = {"num_kv_heads": 2, "head_dim": 8}
EXACT_TOL = 1e-9  # float64


class ConformanceError(AssertionError):
    """A cache type broke the contract; the message names the check, the type and the case."""


def _fail(where: str, message: str) -> None:
    raise ConformanceError(f"{where}: {message}")


def _snapshot_equal(a, b) -> bool:
    if a.columns != b.columns or not torch.equal(a.seen, b.seen) or len(a.layers) != len(b.layers):
        return False
    for x, y in zip(a.layers, b.layers):
        if x.tensors.keys() != y.tensors.keys():
            return False
        for n in x.tensors:
            if x.tensors[n].shape != y.tensors[n].shape or not torch.equal(x.tensors[n], y.tensors[n]):
                return False
    return True


def check_cache_type(
    name: str, params: Mapping[str, Any] | None = None, native: Mapping[str, Any] | None = None, seed: int = 0,
    cases: int = 6,
) -> dict[str, int]:
    """Run the contract checks on cache type `name`; raises ConformanceError naming the first broken property.

    `params`: the type's tunable parameters (default: the class's `example_params`); `native`: the model-side
    parameters (shapes; default: `example_native`, or attention shapes for attention types). Returns how many
    cases each check ran.
    """
    cls = get_layer_class(name)
    params = {**getattr(cls, "example_params", {}), **dict(params or {})}
    storage = params.get("storage")
    if cls.kind == "attention" and isinstance(storage, str) and storage in available_codecs():
        params = {**getattr(codec_class(storage), "kit_params", {}), **params}  # options fitting head_dim 8
    native = dict(native or getattr(cls, "example_native", None) or (ATTENTION_SHAPES if cls.kind == "attention" else {}))
    if cls.kind == "attention":
        return _AttentionKit(name, cls, native, params, seed).run(cases)
    return _RecurrentKit(name, cls, native, params, seed).run(cases)


class _Kit:
    def __init__(self, name: str, cls, native: dict, params: dict, seed: int) -> None:
        self.name, self.cls, self.native, self.params = name, cls, native, params
        self.g = torch.Generator().manual_seed(seed)
        self.counts: dict[str, int] = {}

    def count(self, check: str) -> None:
        self.counts[check] = self.counts.get(check, 0) + 1

    def cache(self, batch: int, max_length: int | None, dtype=torch.float64) -> Cache:
        spec_params = {**self.native, "dtype": dtype}
        config = {"layers": {0: {"type": self.name, **self.params, **({"max_length": max_length} if max_length else {})}}}
        return Cache.build([NativeLayer(self.native_type, spec_params)], batch, config)

    def randint(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def splits(self, n: int) -> list[int]:
        """Block boundaries 0 < ... < n: a prefill then decode steps, or random cuts."""
        if self.randint(0, 1):
            first = self.randint(1, n)
            return [0, *range(first, n + 1)] if first < n else [0, n]
        cuts = sorted({self.randint(1, n - 1) for _ in range(self.randint(0, n - 1))}) if n > 1 else []
        return [0, *cuts, n]

    def pads_mask(self, batch: int, n: int) -> torch.Tensor:
        mask = torch.ones(batch, n, dtype=torch.bool)
        for b in range(1, batch):  # row 0 unpadded, the others padded by up to n-1 columns
            mask[b, : self.randint(0, n - 1)] = False
        return mask

    def expect_refusal(self, where: str, cache: Cache, call: Callable[[], Any], error=CacheError) -> None:
        before = cache.snapshot()
        try:
            call()
        except error:
            pass
        else:
            _fail(where, "a bad call was accepted")
        if not _snapshot_equal(cache.snapshot(), before):
            _fail(where, "a refused call changed the cache")
        self.count("atomic failures")


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
        for case in range(cases):
            for max_length in layouts:
                where = f"'{self.name}' {self.params} {'preallocated' if max_length else 'dynamic'} case {case}"
                self.split_equals_one_shot(where, max_length)
                self.crop(where, max_length)
                self.snapshot_and_rows(where, max_length)
                self.failures(where, max_length)
        return self.counts

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
            _fail(where, f"holds {layer.nbytes()} bytes, more than the {self.held_limit(layer, batch, seen)} its "
                         "pattern needs")
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
        got = self.feed(cache, q[[1, 1]][:, :, n:], k[[1, 1]][:, :, n:], v[[1, 1]][:, :, n:], mask[[1, 1]][:, n:], [0, 1, 2])
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

        for call in (wrong_shape, wrong_dtype, unfed, lambda: layer.update(k[:, :, :1], v[:, :, :1]),
                     lambda: cache.crop(99), lambda: cache.reorder([0, 5])):
            self.expect_refusal(where, cache, call)
        if max_length is not None:
            self.expect_refusal(where, cache, lambda: self.feed(cache, *self.data(2, 50), torch.ones(2, 50, dtype=torch.bool), [0, 50]))


class _RecurrentKit(_Kit):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.native_type = self.name

    def cache(self, batch: int, max_length: int | None, dtype=torch.float64) -> Cache:
        config = {"recurrent": {"type": self.name, **self.params}} if self.params else None
        return Cache.build([NativeLayer(self.name, {**self.native, "dtype": dtype})], batch, config)

    def states(self, cache: Cache) -> dict[str, torch.Tensor]:
        return {n: torch.randn(t.shape, generator=self.g, dtype=torch.float64).to(t.dtype) for n, t in cache[0].states.items()}

    @staticmethod
    def held(layer, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a layer gives back after being handed `states` (its state codec's round trip; lossless: as is)."""
        return layer.round_trip(states) if hasattr(layer, "round_trip") else states

    def feed(self, cache: Cache, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Feed a block of random states; returns the states the layer should hold after it."""
        new = self.states(cache)
        with cache.block(None if bool(mask.all()) else mask, mask.shape[1]):
            cache[0].update(**new)
        return self.held(cache[0], new)

    def run(self, cases: int) -> dict[str, int]:
        for case in range(cases):
            where = f"'{self.name}' case {case}"
            batch = self.randint(1, 3)
            cache = self.cache(batch, None)
            layer = cache[0]
            for name, (shape, dtype) in layer.spec.state_shapes().items():
                t = layer.states[name]
                if tuple(t.shape) != (batch, *shape) or t.dtype != dtype:
                    _fail(where, f"state '{name}' is {tuple(t.shape)} {t.dtype}, the spec says {(batch, *shape)} {dtype}")
            n = self.randint(1, 8)
            mask = self.pads_mask(batch, n)
            new = self.feed(cache, mask)
            if cache.seen.tolist() != mask.sum(1).tolist() or cache.columns != n:
                _fail(where, f"seen {cache.seen.tolist()} after a block with {mask.sum(1).tolist()} real tokens")
            if any(not torch.equal(layer.states[k], v) for k, v in new.items()):
                _fail(where, "the states written in a block are not what the layer holds after it")
            if layer.nbytes() != layer.spec.min_nbytes(batch, n) or cache.nbytes() != cache.plan.held_nbytes(batch, n):
                _fail(where, f"holds {layer.nbytes()} bytes; the spec says {layer.spec.min_nbytes(batch, n)}")
            self.count("states and accounting")
            snap = cache.snapshot()
            after = self.feed(cache, torch.ones(batch, 1, dtype=torch.bool))
            cache.restore(snap)
            if not _snapshot_equal(cache.snapshot(), snap):
                _fail(where, "restore is not bit-exact")
            self.count("snapshot / restore")
            if batch > 1:
                perm = torch.arange(batch).flip(0)
                cache.reorder(perm)
                if any(not torch.equal(layer.states[k], v[perm]) for k, v in new.items()):
                    _fail(where, "reorder did not move the states with their rows")
                cache.restore(snap)
            self.count("reorder / select / repeat")
            cut = self.randint(0, n - 1) if n > 1 else 0
            before = cache.snapshot()
            try:
                cache.crop(cut)
                self.count("crop (exact)")
            except CacheCropError:
                if not _snapshot_equal(cache.snapshot(), before):
                    _fail(where, "a refused crop changed the cache")
                self.count("crop (refused cleanly)")
            cache.restore(snap)
            wrong = {k: v[..., :1] if v.dim() > 1 else v[:0] for k, v in self.states(cache).items()}
            first = next(iter(after))

            def bad(states):
                def call():
                    with cache.block(None, 1):
                        layer.update(**states)
                return call

            for call in (bad(wrong), bad({first: after[first]}) if len(after) > 1 else bad({}),
                         bad({k: v.to(torch.float16) for k, v in after.items()}),
                         lambda: layer.update(**after), lambda: cache.crop(n + 1)):
                self.expect_refusal(where, cache, call)
            self.check_checkpoints(where, batch)
        return self.counts

    def check_checkpoints(self, where: str, batch: int) -> None:
        """With `checkpoints: k`, crop(n) for any of the last k columns gives back exactly the states the layer
        had after column n (handed over as a block's trail or as its final state); an older column is refused."""
        k = self.randint(1, 3)
        config = {"recurrent": {"type": self.name, **self.params, "checkpoints": k}}
        cache = Cache.build([NativeLayer(self.name, {**self.native, "dtype": torch.float64})], batch, config)
        layer = cache[0]
        after = {0: {n: t.clone() for n, t in layer.states.items()}}  # column -> the states after it
        for _ in range(self.randint(1, 3)):
            tokens, start = self.randint(1, 4), cache.columns
            m = layer.trail_length(tokens)
            trail = {n: torch.randn((batch, m, *t.shape[1:]), generator=self.g, dtype=torch.float64).to(t.dtype)
                     for n, t in layer.states.items()}
            final = self.states(cache)
            with cache.block(None, tokens):
                layer.update(trail=trail if m else None, **final)
            held_trail = self.held(layer, trail) if m else {}
            for j in range(m):
                after[start + tokens - m + j] = {n: t[:, j] for n, t in held_trail.items()}
            after[start + tokens] = self.held(layer, final)
        end = cache.columns
        reachable = [c for c in after if end - k <= c < end]  # every such column was a trail or block boundary
        snap = cache.snapshot()
        for n in reachable:
            cache.restore(snap)
            cache.crop(n)
            if cache.columns != n or any(not torch.equal(layer.states[s], after[n][s]) for s in after[n]):
                _fail(where, f"crop({n}) with checkpoints={k} after {end} columns does not give the states after "
                             f"column {n}")
            self.count("crop to a checkpoint (exact)")
        cache.restore(snap)
        too_old = [c for c in after if c < end - k]
        if too_old:
            self.expect_refusal(where, cache, lambda: cache.crop(too_old[-1]))

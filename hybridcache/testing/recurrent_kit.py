"""The conformance kit for recurrent cache types (see hybridcache.testing)."""

from __future__ import annotations

import torch

from hybridcache.cache import Cache, CacheCropError, NativeLayer
from hybridcache.testing.kit import EXACT_TOL, _fail, _Kit, _snapshot_equal  # noqa: F401


class _RecurrentKit(_Kit):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.native_type = self.name

    def cache(self, batch: int, max_length: int | None, dtype=torch.float64) -> Cache:
        config = {"recurrent": {"type": self.name, **self.params}} if self.params else None
        return Cache.build([NativeLayer(self.name, {**self.native, "dtype": dtype})], batch, config)

    def states(self, cache: Cache) -> dict[str, torch.Tensor]:
        return {
            n: torch.randn(t.shape, generator=self.g, dtype=torch.float64).to(t.dtype)
            for n, t in cache[0].states.items()
        }

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
                    _fail(
                        where, f"state '{name}' is {tuple(t.shape)} {t.dtype}, the spec says {(batch, *shape)} {dtype}"
                    )
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

            def bad(states, cache=cache, layer=layer):
                def attempt():
                    with cache.block(None, 1):
                        layer.update(**states)

                return attempt

            for call in (
                bad(wrong),
                bad({first: after[first]}) if len(after) > 1 else bad({}),
                bad({k: v.to(torch.float16) for k, v in after.items()}),
                lambda layer=layer, after=after: layer.update(**after),
                lambda cache=cache, n=n: cache.crop(n + 1),
            ):
                self.expect_refusal(where, cache, call)
            self.check_checkpoints(where, batch)
        return self.counts

    def check_checkpoints(self, where: str, batch: int) -> None:
        """With `rollback: k`, crop(n) for any of the last k columns gives back exactly the states the layer
        had after column n (handed over as a block's trail or as its final state); an older column is refused."""
        k = self.randint(1, 3)
        config = {"recurrent": {"type": self.name, **self.params, "rollback": k}}
        cache = Cache.build([NativeLayer(self.name, {**self.native, "dtype": torch.float64})], batch, config)
        layer = cache[0]
        after = {0: {n: t.clone() for n, t in layer.states.items()}}  # column -> the states after it
        for _ in range(self.randint(1, 3)):
            tokens, start = self.randint(1, 4), cache.columns
            m = layer.trail_length(tokens)
            trail = {
                n: torch.randn((batch, m, *t.shape[1:]), generator=self.g, dtype=torch.float64).to(t.dtype)
                for n, t in layer.states.items()
            }
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
                _fail(
                    where, f"crop({n}) with rollback={k} after {end} columns does not give the states after column {n}"
                )
            self.count("crop to a checkpoint (exact)")
        cache.restore(snap)
        too_old = [c for c in after if c < end - k]
        if too_old:
            self.expect_refusal(where, cache, lambda: cache.crop(too_old[-1]))

"""Rollback of recurrent state: with `checkpoints: k`, cache.crop(n) is exact for any n in the last k columns.

The oracle is a recompute without the operation: a fresh cache fed only the first n columns. Families whose
native attention evicts (sliding, chunked) get full attention here, so every crop exercises the recurrent layers.
In float64 (states too), where a rollback bug shows far above 1e-9 and float32 rounding (decode and whole-block
projections sum in different orders) cannot hide one or fail a correct one.
"""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, CacheCropError, NativeLayer
from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.testing import check_cache_type
from tests.models.conftest import prompts

K = 5


def _config(model, k=K):
    config = {"recurrent": {"checkpoints": k, "state_dtype": torch.float64}}
    if any(layer.kind == "attention" and layer.type_name != "full" for layer in model.make_cache(1).layers):
        config["attention"] = {"type": "full"}
    return config


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_within_the_checkpoint_window_equals_recompute(models, family):
    model = models(family, torch.float64)[0]
    config = _config(model)
    ids = prompts(2, 20, seed=11)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0  # left padding in row 1
    cache = model.make_cache(2, config)
    model(ids[:, :12], cache, mask[:, :12])  # a prompt block
    model(ids[:, 12:17], cache, mask[:, :17])  # a verify-style block of 5
    for t in range(17, 20):  # decode steps
        model(ids[:, t : t + 1], cache)
    assert cache.columns == 20
    snap = cache.snapshot()
    follow = prompts(2, 3, seed=12)
    for n in range(20 - K, 21):
        cache.restore(snap)
        cache.crop(n)
        fresh = model.make_cache(2, config)
        model(ids[:, :n], fresh, mask[:, :n], allow_padding_rows=True)
        for a, b in zip(cache.layers, fresh.layers):
            if a.kind == "recurrent":
                for name in a.states:
                    torch.testing.assert_close(a.states[name], b.states[name], atol=1e-9, rtol=0)
        ext = torch.cat([mask[:, :n], torch.ones(2, 3, dtype=torch.long)], 1)
        got, want = model(follow, cache, ext), model(follow, fresh, ext)
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    cache.restore(snap)
    if any(layer.kind == "recurrent" for layer in cache.layers):
        before = cache.snapshot()
        with pytest.raises(CacheCropError, match="checkpoints"):
            cache.crop(20 - K - 1)
        after = cache.snapshot()
        assert all(
            torch.equal(x.tensors[k], y.tensors[k]) for x, y in zip(before.layers, after.layers) for k in x.tensors
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_checkpoints_equals_the_oracle(models, family):
    """Checkpoints route a block's last tokens through the step path: same results (to rounding) as without."""
    model = models(family)[0]
    ids = prompts(2, 9, seed=13)
    out = hc.generate(model, ids, max_new_tokens=6, cache_config=_config(model), prefill_chunk_size=4)
    ref = hc.generate(model, ids, max_new_tokens=6, cache_config=_config(model), use_cache=False)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_without_checkpoints_crop_refuses_and_says_how():
    cache = Cache.build([NativeLayer("mamba", {"intermediate_size": 4, "state_size": 2, "conv_kernel": 3})], 1)
    with cache.block(None, 3):
        cache[0].update(conv=torch.ones(1, 4, 2), ssm=torch.ones(1, 4, 2))
    with pytest.raises(CacheCropError, match=r"checkpoints: k"):
        cache.crop(2)


def test_trail_bookkeeping_against_states_written_by_hand():
    """Synthetic states: the state after column c is filled with c; every crop in the window gives it back."""
    native = [NativeLayer("rglru", {"lru_width": 3, "conv_kernel": 2})]
    cache = Cache.build(native, 2, {"recurrent": {"checkpoints": 4}})
    layer = cache[0]

    def state(c):
        return {"conv": torch.full((2, 3, 1), float(c)), "lru": torch.full((2, 3), float(c))}

    for size in (3, 1, 2, 1, 4, 1):
        start = cache.columns
        with cache.block(None, size):
            m = layer.trail_length(size)
            trail = (
                {
                    k: torch.stack([state(c)[k] for c in range(start + size - m, start + size)], 1)
                    for k in ("conv", "lru")
                }
                if m
                else None
            )
            layer.update(trail=trail, **state(start + size))
        snap = cache.snapshot()
        for n in range(max(0, cache.columns - 4), cache.columns + 1):
            cache.crop(n)
            assert torch.equal(layer.states["lru"], state(n)["lru"]) and cache.columns == n
            cache.restore(snap)


@pytest.mark.parametrize("name", ["mamba", "mamba2", "rglru", "conv", "gated_delta"])
def test_conformance_kit_with_checkpoints(name):
    check_cache_type(name, params={"checkpoints": 3})

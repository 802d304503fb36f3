"""Rollback of recurrent state: with `rollback: k`, cache.crop(n) is exact for any n in the last k columns.

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
    config = {"recurrent": {"rollback": k, "state_dtype": torch.float64}}
    if any(layer.kind == "attention" and layer.type_name != "full" for layer in model.make_cache(1).layers):
        config["attention"] = {"type": "full"}
    return config


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_within_the_rollback_window_equals_recompute(models, family):
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
        with pytest.raises(CacheCropError, match="rollback"):
            cache.crop(20 - K - 1)
        after = cache.snapshot()
        assert all(
            torch.equal(x.tensors[k], y.tensors[k]) for x, y in zip(before.layers, after.layers) for k in x.tensors
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_rollback_equals_the_oracle(models, family):
    """Checkpoints route a block's last tokens through the step path: same results (to rounding) as without."""
    model = models(family)[0]
    ids = prompts(2, 9, seed=13)
    out = hc.generate(model, ids, max_new_tokens=6, cache_config=_config(model), prefill_chunk_size=4)
    ref = hc.generate(model, ids, max_new_tokens=6, cache_config=_config(model), use_cache=False)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_without_rollback_crop_refuses_and_says_how():
    cache = Cache.build([NativeLayer("mamba", {"intermediate_size": 4, "state_size": 2, "conv_kernel": 3})], 1)
    with cache.block(None, 3):
        cache[0].update(conv=torch.ones(1, 4, 2), ssm=torch.ones(1, 4, 2))
    with pytest.raises(CacheCropError, match=r"rollback: k"):
        cache.crop(2)


def test_trail_bookkeeping_against_states_written_by_hand():
    """Synthetic states: the state after column c is filled with c; every crop in the window gives it back."""
    native = [NativeLayer("rglru", {"lru_width": 3, "conv_kernel": 2})]
    cache = Cache.build(native, 2, {"recurrent": {"rollback": 4}})
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
def test_conformance_kit_with_rollback(name):
    check_cache_type(name, params={"rollback": 3})


@pytest.mark.parametrize("config", [{"recurrent": {"checkpoints": 2}}, {"mamba": {"type": "mamba", "checkpoints": 2}}])
def test_the_old_name_checkpoints_is_refused_naming_rollback(config):
    """`checkpoints: k` was renamed to `rollback: k` (2026-11-29: a checkpoint is a model's weights): a config still
    giving it is told the new name, before anything is built."""
    native = [NativeLayer("mamba", {"intermediate_size": 4, "state_size": 2, "conv_kernel": 3})]
    with pytest.raises(hc.cache.CacheConfigError, match=r"\.checkpoints was renamed to 'rollback'"):
        Cache.build(native, 1, config)


def test_a_file_saved_with_checkpoints_loads_as_rollback_and_crops(models, tmp_path):
    """A cache saved before the rename (its recurrent specs recorded with `checkpoints`) loads with the same specs,
    and its trail still rewinds: crop then continue equals the saved cache cropped and continued."""
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from hybridcache.cache.io.persistence import _metadata, header_sha256

    model = models("jamba")[0]
    ids = prompts(1, 12, seed=5)
    cache = model.make_cache(1, {"recurrent": {"rollback": 3}})
    model(ids[:, :10], cache=cache)
    cache.save(tmp_path / "new", model=model)
    data = (tmp_path / "new").read_bytes()
    header = json.loads(_metadata(data)["hybridcache"])
    renamed = 0
    for layer in header["layers"]:
        if "rollback" in layer["spec"]:
            layer["spec"]["checkpoints"] = layer["spec"].pop("rollback")  # as saved before 2026-11-29
            renamed += 1
    assert renamed
    header["header_sha256"] = header_sha256(header)
    (tmp_path / "old").write_bytes(st_save(st_load(data), metadata={"hybridcache": json.dumps(header)}))
    loaded = Cache.load(tmp_path / "old", model=model)
    assert [layer.spec for layer in loaded.layers] == [layer.spec for layer in cache.layers]
    cache.crop(8)
    loaded.crop(8)
    a, b = model(ids[:, 8:], cache=cache), model(ids[:, 8:], cache=loaded)
    assert torch.equal(getattr(a, "logits", a), getattr(b, "logits", b))

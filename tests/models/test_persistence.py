"""Cache.save / Cache.load: bit-exact round trip, continuation equals continuing from the original, clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridcache as hc
from hybridcache.cache import Cache
from hybridcache.cache.io.persistence import CacheFileError
from hybridcache.checkpoints.tiny import FAMILIES
from tests.models.conftest import prompts


def _same(a: Cache, b: Cache) -> bool:
    sa, sb = a.snapshot(), b.snapshot()
    if sa.columns != sb.columns or not torch.equal(sa.seen, sb.seen) or not torch.equal(sa.fingerprint, sb.fingerprint):
        return False
    return all(
        x.spec == y.spec
        and x.tensors.keys() == y.tensors.keys()
        and all(x.tensors[n].dtype == y.tensors[n].dtype and torch.equal(x.tensors[n], y.tensors[n]) for n in x.tensors)
        for x, y in zip(sa.layers, sb.layers)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact_and_continues_like_the_original(models, family, tmp_path):
    model = models(family)[0]
    ids = prompts(2, 11, seed=1)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=4)
    out.cache.save(tmp_path / "c.safetensors")
    loaded = Cache.load(tmp_path / "c.safetensors", model=model)
    assert _same(out.cache, loaded)
    more = torch.cat([out.sequences, prompts(2, 3, seed=2)], dim=1)
    full = torch.cat([mask, torch.ones(2, 7, dtype=torch.long)], dim=1)
    a = hc.generate(model, more, attention_mask=full, cache=out.cache, max_new_tokens=5)
    b = hc.generate(model, more, attention_mask=full, cache=loaded, max_new_tokens=5)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logits, b.logits)
    # the independent oracle: no cache at all, the whole sequence recomputed at every step
    ref = hc.generate(model, more, attention_mask=full, max_new_tokens=5, use_cache=False)
    assert torch.equal(b.sequences, ref.sequences)
    torch.testing.assert_close(b.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_preallocated_and_configured_caches_round_trip(models, tmp_path):
    model = models("jamba")[0]
    config = {"attention": {"type": "sliding", "window": 4, "storage": "int8"}}
    out = hc.generate(model, prompts(1, 9, seed=3), max_new_tokens=3, cache_config=config)
    out.cache.save(tmp_path / "a", model=model)
    assert _same(out.cache, Cache.load(tmp_path / "a", model, batch_size=1, cache_config=config))
    static = hc.generate(
        model, prompts(1, 9, seed=3), max_new_tokens=3, compile=False, cache=model.make_cache(1, max_length=16)
    )
    static.cache.save(tmp_path / "b", model=model)
    assert _same(static.cache, Cache.load(tmp_path / "b", model))
    with pytest.raises(CacheFileError, match="differ from what cache_config asks"):
        Cache.load(tmp_path / "a", model, cache_config={})


def test_wrong_model_batch_or_spec_is_a_clear_error(models, tmp_path):
    jamba, mamba = models("jamba")[0], models("mamba")[0]
    out = hc.generate(jamba, prompts(2, 6, seed=4), max_new_tokens=2)
    path = out.cache.save(tmp_path / "c")
    with pytest.raises(CacheFileError, match="'jamba' model that differs from this 'mamba' model"):
        Cache.load(path, mamba)
    with pytest.raises(CacheFileError, match="batch of 2 rows, batch_size=1"):
        Cache.load(path, jamba, batch_size=1)
    with pytest.raises(CacheFileError, match="differ from what cache_config asks"):
        Cache.load(path, jamba, cache_config={"attention": {"type": "sliding", "window": 4}})
    other = hc.from_pretrained(_checkpoint_dir(jamba), dtype=torch.float32)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)  # same config, other weights
    with pytest.raises(CacheFileError, match="weights_sha256"):
        Cache.load(path, other)
    with pytest.raises(hc.cache.CacheError, match="pass model="):
        jamba.make_cache(1).save(tmp_path / "d")


def _checkpoint_dir(model):
    from hybridcache.checkpoints.tiny import tiny_checkpoint

    return tiny_checkpoint(model.family)


def test_corrupted_truncated_or_foreign_files_are_clear_errors(models, tmp_path):
    model = models("mamba2")[0]
    path = hc.generate(model, prompts(1, 7, seed=5), max_new_tokens=2).cache.save(tmp_path / "c")
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(data[: len(data) - 9]))
    with pytest.raises(CacheFileError, match="corrupted or truncated"):
        Cache.load(bad, model)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # one payload byte
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CacheFileError, match="sha256"):
        Cache.load(bad, model)
    save_file({"x": torch.zeros(2)}, str(bad))
    with pytest.raises(CacheFileError, match="not a saved hybridcache"):
        Cache.load(bad, model)
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["hybridcache"])
    header["version"] = 99
    save_file(tensors, str(bad), metadata={"hybridcache": json.dumps(header)})
    with pytest.raises(CacheFileError, match="version 99"):
        Cache.load(bad, model)
    # an edited header with an intact payload: here the sequence claims one column more than was fed
    header["version"], header["columns"] = 2, header["columns"] + 1
    save_file(tensors, str(bad), metadata={"hybridcache": json.dumps(header)})
    with pytest.raises(CacheFileError, match="header does not match its sha256"):
        Cache.load(bad, model)
    with pytest.raises(FileNotFoundError):
        Cache.load(tmp_path / "missing", model)
    assert b"pickle" not in data and not data.startswith(b"\x80")  # safetensors, never a pickle


def test_a_loaded_cache_can_be_cropped_and_continued(models, tmp_path):
    """The token fingerprint's per-column history is saved: crop after load still knows the kept tokens."""
    model = models("jamba")[0]
    ids = prompts(1, 9, seed=21)
    out = hc.generate(model, ids, max_new_tokens=4, cache_config={"recurrent": {"rollback": 3}})
    out.cache.save(tmp_path / "c.safetensors")
    loaded = Cache.load(tmp_path / "c.safetensors", model=model, cache_config={"recurrent": {"rollback": 3}})
    keep = loaded.columns - 2
    loaded.crop(keep)
    prefix = out.sequences[:, : keep + 1]  # the kept columns and one token to feed
    wrong = prefix.clone()
    wrong[0, 1] = (wrong[0, 1] + 1) % 384  # not the token the cache saw at column 1
    with pytest.raises(ValueError, match="not the tokens the cache saw"):
        hc.generate(model, wrong, max_new_tokens=4, cache=loaded)
    again = hc.generate(model, prefix, max_new_tokens=4, cache=loaded)
    ref = hc.generate(model, prefix, max_new_tokens=4, use_cache=False)
    assert torch.equal(again.sequences, ref.sequences)

"""The inputs the generated suites found getting through (issue 22's standing suite), pinned one by one: each was a
bare Python / torch error, an accepted call or a changed cache before its fix."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, CacheConfigError, CacheError
from hybridcache.cache.io.persistence import CacheFileError
from hybridcache.generation.sources.speculative import with_recurrent_rollback
from hybridcache.models import CheckpointError, ConfigError
from hybridcache.models.core.base import GenerationError, GenerationTypeError
from tests.cache.helpers import feed, hybrid_cache, state_equal
from tests.models.conftest import prompts

META = torch.zeros(2, dtype=torch.long, device="meta")


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c[torch.tensor(True)],  # was: layer 1
        lambda c: c.select([10**30]),  # was: ValueError "Overflow when unpacking long long" from torch.tensor
        lambda c: c.reorder([1, 2**63]),
        lambda c: c.select(META),  # was: RuntimeError "Tensor.item() cannot be called on meta tensors"
        lambda c: c.begin_block(torch.ones(2, 2, dtype=torch.long, device="meta"), 2),  # was: the same RuntimeError
        lambda c: c.begin_block(None, 2**63 - 1),  # was: RuntimeError "Storage size calculation overflowed"
        lambda c: c.begin_block(None, 10**40),  # was: TypeError from torch.ones
        lambda c: c.begin_block(None, 10**13),  # would allocate 2 x 10^13 mask entries: refused before (memory)
        lambda c: c.restore(replace(c.snapshot(), seen=c.snapshot().seen.to("meta"))),  # was: RuntimeError
        lambda c: c.restore(replace(c.snapshot(), layers=(None,) * 7)),  # was: AttributeError
        lambda c: c.restore(
            _edited(c, 0, "keys_data", lambda t: torch.zeros_like(t, device="meta"))
        ),  # NotImplementedError
        # was accepted: keys of 6 slots for key_pos of 5; the next update failed with a RuntimeError in append_buffer
        lambda c: c.restore(_edited(c, 0, "keys_data", lambda t: torch.cat([t, t[:, :, :1]], 2))),
    ],
    ids=[
        "bool tensor key",
        "select 1e30",
        "reorder 2**63",
        "select on meta",
        "mask on meta",
        "block 2**63-1",
        "block 1e40",
        "block 1e13",
        "seen on meta",
        "layers None",
        "tensor on meta",
        "slots disagree",
    ],
)
def test_cache_calls_that_got_through(call):
    cache = hybrid_cache()  # dynamic: attention storage grows with what it holds
    feed(cache, 5)
    before = cache.snapshot()
    with pytest.raises(CacheError):
        call(cache)
    assert state_equal(cache.snapshot(), before)
    feed(cache, 1)  # and the cache still works


def _edited(cache, i, name, edit):
    snap = cache.snapshot()
    layer = snap.layers[i]
    layers = list(snap.layers)
    layers[i] = replace(layer, tensors={**layer.tensors, name: edit(layer.tensors[name])})
    return replace(snap, layers=tuple(layers))


@pytest.fixture(scope="module")
def model(models):
    return models("gemma3")[0]


def test_model_call_errors_are_generation_errors(model):
    ids = prompts(2, 6, seed=0)
    out = hc.generate(model, ids, max_new_tokens=2)
    before = out.cache.snapshot()
    for kwargs, message in [
        (dict(attention_mask=torch.full((2, 8), 2)), "only 0 and 1"),  # were plain ValueErrors
        (dict(attention_mask=torch.tensor([[1] * 7 + [0]] * 2)), "padding"),
        (dict(attention_mask=torch.full((2, 8), 0.5)), "bool or an integer"),
    ]:
        with pytest.raises(GenerationError, match=message):
            hc.generate(model, out.sequences, cache=out.cache, **kwargs)
    with pytest.raises(GenerationError, match="all padding"):
        model(prompts(2, 3, seed=0), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(GenerationTypeError, match="cache must be a hybridcache Cache"):  # still a TypeError
        hc.generate(model, ids, cache="x")
    for store in ("x", 5, {}):  # were AttributeError: no attribute 'prepare'
        with pytest.raises(GenerationTypeError, match="prefix_cache must be a PrefixStore"):
            hc.generate(model, ids, prefix_cache=store)
    assert state_equal(out.cache.snapshot(), before)


@pytest.mark.parametrize("config", [5, "int8", {"recurrent": "x"}, {"recurrent": {"rollback": "2"}}])
def test_a_draft_cache_config_that_is_no_config(model, config):
    with pytest.raises(CacheConfigError):  # was TypeError: 'int' object is not iterable (and ValueError from int())
        with_recurrent_rollback(config, 4)
    with pytest.raises(CacheError):
        hc.generate(model, prompts(1, 4, seed=0), max_new_tokens=2, draft_model=model, draft_cache_config=config)


def test_checkpoint_configs_that_got_through(checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints("gemma3"), path)
    config = json.loads((path / "config.json").read_text())
    for change, error, message in [
        ({"model_type": "llama"}, ConfigError, "unsupported model_type"),  # was a plain ValueError
        ({"model_type": None}, ConfigError, "unsupported model_type"),
        ({"head_dim": 2**63}, ConfigError, "int64"),  # was RuntimeError from torch
    ]:
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(error, match=message):
            hc.from_pretrained(path)
    (path / "config.json").write_bytes(b"[" * 100000 + b"]" * 100000)  # was RecursionError
    with pytest.raises(CheckpointError, match="nested too deeply"):
        hc.from_pretrained(path)
    outside = tmp_path / "config.json"  # was accepted: config.json linked out of the directory
    outside.write_text(json.dumps(config))
    (path / "config.json").unlink()
    (path / "config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="config.json is a symbolic link"):
        hc.from_pretrained(path)


def test_cache_files_that_got_through(models, tmp_path):
    from tests.models.test_cache_files_hostile import forge, read

    model = models("jamba")[0]
    out = hc.generate(model, prompts(1, 5, seed=1), max_new_tokens=2)
    path = out.cache.save(tmp_path / "c.safetensors", model=model)
    for bad in ("x", None, 5):  # were AttributeError: no attribute 'state_dict'
        with pytest.raises(CacheError, match="model must be"):
            Cache.load(path, bad)
    header, tensors = read(path)
    layers = [dict(r) for r in header["layers"]]
    layers[2] = {**layers[2], "native_type": "ful"}  # was accepted
    with pytest.raises(CacheFileError, match="native_type"):
        Cache.load(forge(path, tmp_path / "a", {**header, "layers": layers}, tensors), model)
    layers[2] = {**header["layers"][2], "spec": {**header["layers"][2]["spec"], "max_length": 2**63}}  # TypeError
    with pytest.raises(CacheFileError, match="layer 2"):
        Cache.load(forge(path, tmp_path / "b", {**header, "layers": layers}, tensors), model)

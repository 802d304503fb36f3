"""Checkpoint loading: sharded safetensors, clear errors for unsupported types and bad tensors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridcache as hc
from tests.models.conftest import prompts


@pytest.fixture
def gemma_dir(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoints("gemma3"), target)
    return target


def rewrite(directory, change):
    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, directory / "model.safetensors")


def test_sharded_checkpoint_loads_the_same_weights(gemma_dir, models):
    ours, _ = models("gemma3")
    state = load_file(gemma_dir / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, gemma_dir / file)
    (gemma_dir / "model.safetensors").unlink()
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (gemma_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = hc.from_pretrained(gemma_dir)
    ids = prompts(1, 9, seed=0)
    with torch.no_grad():
        assert torch.equal(sharded(ids), ours(ids))


def test_unsupported_model_type_lists_supported(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    (gemma_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: gemma3_text, jamba, llama4_text"):
        hc.from_pretrained(gemma_dir)


def test_missing_tensor_is_named(gemma_dir):
    rewrite(gemma_dir, lambda s: s.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensors .*model.layers.2.self_attn.k_norm.weight"):
        hc.from_pretrained(gemma_dir)


def test_unexpected_tensor_is_named(gemma_dir):
    rewrite(gemma_dir, lambda s: s.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"does not use: model.layers.9.extra.weight"):
        hc.from_pretrained(gemma_dir)


def test_shape_mismatch_is_named(gemma_dir):
    rewrite(gemma_dir, lambda s: s.update({"model.norm.weight": torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(7,\) in the checkpoint, the model expects \(64,\)"):
        hc.from_pretrained(gemma_dir)


def test_missing_paths_fail_clearly(tmp_path, gemma_dir):
    with pytest.raises(FileNotFoundError, match="not a local directory and could not be fetched"):
        hc.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="is a file"):
        hc.from_pretrained(gemma_dir / "config.json")
    (gemma_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hc.from_pretrained(gemma_dir)


def test_tied_embeddings_share_the_matrix(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    (gemma_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    rewrite(gemma_dir, lambda s: s.pop("lm_head.weight"))
    model = hc.from_pretrained(gemma_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_dtype_and_device_arguments(gemma_dir):
    model = hc.from_pretrained(gemma_dir, dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16
    cache = model.make_cache(1)
    assert cache[0].spec.dtype == torch.bfloat16
    out = hc.generate(model, prompts(1, 5, seed=0), max_new_tokens=3)
    assert out.sequences.shape == (1, 8)

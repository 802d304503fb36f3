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
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: ") as err:
        hc.from_pretrained(gemma_dir)
    supported = str(err.value).split("supported: ")[1].split(", ")
    assert {"gemma3_text", "jamba", "llama4_text", "mamba", "mamba2", "recurrent_gemma", "zamba2"} <= set(supported)
    assert supported == sorted(supported)


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
    with pytest.raises(
        ValueError, match=r"model.norm.weight has shape \(7,\) in the checkpoint, the model expects \(64,\)"
    ):
        hc.from_pretrained(gemma_dir)


def test_missing_paths_fail_clearly(tmp_path, gemma_dir):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nope' does not exist"):
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


# -- issue 12: loading -------------------------------------------------------------------------------------------
def write_config(directory, change):
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_config_disagreeing_with_weights_fails_before_reading_or_allocating(gemma_dir, monkeypatch):
    """vocab_size 1e9 would be 256 GB of embeddings: the header check names the tensor before anything is built."""
    import hybridcache.models.core.loading as loading

    write_config(gemma_dir, lambda c: c.update(vocab_size=10**9))
    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("tensors read before the shape check"))
    with pytest.raises(
        hc.models.CheckpointError,
        match=r"model.embed_tokens.weight has shape \(384, 64\) in the checkpoint, the model expects "
        r"\(1000000000, 64\)",
    ):
        hc.from_pretrained(gemma_dir)


def test_loaded_model_has_no_meta_tensors(gemma_dir):
    model = hc.from_pretrained(gemma_dir)
    assert not [n for n, t in model.state_dict().items() if t.is_meta]
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", r"config.json must hold a JSON object, it holds a JSON list"),
        ('"gemma"', r"config.json must hold a JSON object, it holds a JSON str"),
        (
            '{\n  "model_type": "gemma3_text",\n  "hidden_size": 64,\n}\n',
            r"config.json: invalid JSON at line 4, column 1",
        ),
    ],
)
def test_bad_config_json_is_named(gemma_dir, text, message):
    (gemma_dir / "config.json").write_text(text)
    with pytest.raises(hc.models.CheckpointError, match=message):
        hc.from_pretrained(gemma_dir)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: c.pop("hidden_size"),
            r"gemma3 config \(.*config.json\) is invalid: missing required field hidden_size",
        ),
        (lambda c: c.update(hidden_size="64"), r"hidden_size must be int, got '64' \(str\)"),
        (lambda c: c.update(num_key_value_heads=True), r"num_key_value_heads must be int( or null)?, got True"),
        (
            lambda c: c.update(layer_types=["sliding_attention", "sliding_attention", "full", "sliding_attention"]),
            r"layer_types has unknown entry 'full' \(known: sliding_attention, full_attention\)",
        ),
        (lambda c: c.update(sliding_window=0), r"sliding_window must be positive, got 0"),
        (lambda c: c.update(sliding_window=-8), r"sliding_window must be positive, got -8"),
        (lambda c: c.update(layer_types=["full_attention"]), r"layer_types has 1 entries, num_hidden_layers is 4"),
    ],
)
def test_bad_config_values_fail_at_load(gemma_dir, change, message):
    write_config(gemma_dir, change)
    with pytest.raises(hc.models.ConfigError, match=message):
        hc.from_pretrained(gemma_dir)


def test_llama4_zero_chunk_and_recurrentgemma_zero_window_fail_at_load(checkpoints, tmp_path):
    for family, change, message in [
        ("llama4", {"attention_chunk_size": 0}, "attention_chunk_size must be positive, got 0"),
        (
            "llama4",
            {"layer_types": ["chunked_attention"] * 3 + ["sliding_attention"]},
            "layer_types has unknown entry 'sliding_attention'",
        ),
        ("recurrentgemma", {"attention_window_size": 0}, "attention_window_size must be positive, got 0"),
        ("recurrentgemma", {"block_types": ["recurrent", "mlp"]}, "block_types has unknown entry 'mlp'"),
        ("jamba", {"layers_block_type": ["mamba", "mamba", "attn", "mamba"]}, "layers_block_type has unknown entry"),
    ]:
        target = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(checkpoints(family), target)
        write_config(target, lambda c, change=change: c.update(change))
        with pytest.raises(hc.models.ConfigError, match=message):
            hc.from_pretrained(target)


def test_nonfinite_weights_are_refused_unless_allowed(gemma_dir):
    def poison(state):
        state["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")

    rewrite(gemma_dir, poison)
    with pytest.raises(
        hc.models.CheckpointError,
        match=r"tensor model.layers.1.mlp.up_proj.weight has 2 NaN/Inf values .*allow_nonfinite=True",
    ):
        hc.from_pretrained(gemma_dir)
    model = hc.from_pretrained(gemma_dir, allow_nonfinite=True)
    assert torch.isnan(model.model.layers[1].mlp.up_proj.weight[3, 5])


def test_integer_tensor_where_floats_are_expected_is_refused_unless_allowed(gemma_dir):
    rewrite(gemma_dir, lambda s: s.update({"model.norm.weight": torch.arange(64, dtype=torch.int64)}))
    with pytest.raises(
        hc.models.CheckpointError,
        match=r"tensor model.norm.weight has dtype torch.int64 in the checkpoint, the model expects a "
        r"floating-point tensor .*allow_dtype_cast=True",
    ):
        hc.from_pretrained(gemma_dir)
    model = hc.from_pretrained(gemma_dir, allow_dtype_cast=True)
    assert model.model.norm.weight.dtype == torch.float32 and model.model.norm.weight[5].item() == 5.0


def test_half_precision_checkpoint_loads_in_the_requested_dtype(gemma_dir, models):
    ours, _ = models("gemma3")
    rewrite(gemma_dir, lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items()}))
    model = hc.from_pretrained(gemma_dir, dtype=torch.float32)
    assert model.dtype == torch.float32
    expected = ours.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, expected)


def shard(directory, shard_names):
    """Split model.safetensors into shards named `shard_names` (paths relative to `directory`) plus the index."""
    state = load_file(directory / "model.safetensors")
    names = sorted(state)
    weight_map = {}
    for i, file in enumerate(shard_names):
        keys = names[i :: len(shard_names)]
        save_file({k: state[k] for k in keys}, directory / file)
        weight_map.update({k: file for k in keys})
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_shard_paths_must_stay_inside_the_checkpoint(gemma_dir):
    shard(gemma_dir, ["model-00001-of-00002.safetensors", "../outside.safetensors"])
    assert (gemma_dir.parent / "outside.safetensors").exists()  # the old loader read it
    with pytest.raises(hc.models.CheckpointError, match=r"shard path '../outside.safetensors' points outside"):
        hc.from_pretrained(gemma_dir)


def test_absolute_shard_paths_are_refused(gemma_dir, tmp_path):
    outside = str(tmp_path / "abs.safetensors")
    shard(gemma_dir, ["model-00001-of-00002.safetensors", outside])
    with pytest.raises(hc.models.CheckpointError, match="points outside the checkpoint directory"):
        hc.from_pretrained(gemma_dir)


def test_subfolder_shards_load_and_bad_indexes_are_named(gemma_dir, models):
    (gemma_dir / "weights").mkdir()
    weight_map = shard(gemma_dir, ["weights/a.safetensors", "weights/b.safetensors"])
    ours, _ = models("gemma3")
    ids = prompts(1, 5, seed=1)
    with torch.no_grad():
        assert torch.equal(hc.from_pretrained(gemma_dir)(ids), ours(ids))
    index = gemma_dir / "model.safetensors.index.json"
    name = sorted(weight_map)[0]
    index.write_text(json.dumps({"weight_map": {**weight_map, name: "weights/b.safetensors"}}))
    with pytest.raises(hc.models.CheckpointError, match=f"lists tensor {name} in b.safetensors, which does not hold"):
        hc.from_pretrained(gemma_dir)
    index.write_text(json.dumps({"weight_map": []}))
    with pytest.raises(hc.models.CheckpointError, match="'weight_map' must be a non-empty object"):
        hc.from_pretrained(gemma_dir)
    index.write_text('{"weight_map": {')
    with pytest.raises(hc.models.CheckpointError, match=r"model.safetensors.index.json: invalid JSON at line 1"):
        hc.from_pretrained(gemma_dir)


@pytest.mark.parametrize(
    "path",
    ["./no/such/dir", "/tmp/hybridcache-no-such-dir-x", "~/no-such-hybridcache-dir", "no/such/dir", "..", "bad name"],
)
def test_missing_local_paths_never_reach_the_hub(path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    if path == "..":
        path = "../hybridcache-no-such-dir"
    with pytest.raises(FileNotFoundError, match=f"checkpoint directory '{path}' does not exist"):
        hc.from_pretrained(path)


def test_partly_existing_path_is_local_and_hub_ids_still_go_to_the_hub(gemma_dir, tmp_path, monkeypatch):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **k: asked.append(repo) or str(gemma_dir))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    with pytest.raises(FileNotFoundError, match="checkpoint directory 'org/model' does not exist"):
        hc.from_pretrained("org/model")
    assert hc.from_pretrained("google/gemma-tiny").family == "gemma3"
    assert asked == ["google/gemma-tiny"]


def test_convert_checkpoint_hook_runs_before_names_are_matched(gemma_dir, monkeypatch, models):
    from hybridcache.models.families.gemma3 import Gemma3LM

    rewrite(gemma_dir, lambda s: s.update({"model.final_norm.weight": s.pop("model.norm.weight") * 2}))
    with pytest.raises(hc.models.CheckpointError, match="missing 1 tensors the gemma3 model needs: model.norm.weight"):
        hc.from_pretrained(gemma_dir)

    def convert(self, state):
        state["model.norm.weight"] = state.pop("model.final_norm.weight") / 2  # alias and fold a multiplier
        return state

    monkeypatch.setattr(Gemma3LM, "convert_checkpoint", convert, raising=False)
    ours, _ = models("gemma3")
    model = hc.from_pretrained(gemma_dir)
    assert torch.equal(model.model.norm.weight, ours.model.norm.weight)


def test_models_with_tensors_the_checkpoint_cannot_fill_are_checked_on_meta_then_built_for_real(gemma_dir, monkeypatch):
    from hybridcache.models.families.gemma3 import Gemma3LM

    init = Gemma3LM.__init__
    built = []

    def with_plain_tensor(self, config):
        init(self, config)
        self.offsets = torch.ones(3)  # a plain attribute: on the meta device it would never get values
        built.append(self.offsets.is_meta)

    monkeypatch.setattr(Gemma3LM, "__init__", with_plain_tensor)
    model = hc.from_pretrained(gemma_dir)
    assert built == [True, False] and torch.equal(model.offsets, torch.ones(3))
    write_config(gemma_dir, lambda c: c.update(vocab_size=10**9))
    with pytest.raises(hc.models.CheckpointError, match="model.embed_tokens.weight has shape"):
        hc.from_pretrained(gemma_dir)
    assert built[-1] is True  # refused from the meta build, never built for real


def test_an_identity_convert_hook_on_the_base_class_keeps_the_header_check(gemma_dir, monkeypatch):
    import hybridcache.models.core.loading as loading
    from hybridcache.models.core.base import HybridLM

    monkeypatch.setattr(HybridLM, "convert_checkpoint", lambda self, state: state, raising=False)
    write_config(gemma_dir, lambda c: c.update(vocab_size=10**9))
    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("tensors read before the shape check"))
    with pytest.raises(hc.models.CheckpointError, match=r"model.embed_tokens.weight has shape \(384, 64\)"):
        hc.from_pretrained(gemma_dir)


def test_a_converting_family_that_must_be_built_for_real_is_checked_first(checkpoints, tmp_path, monkeypatch):
    """Zamba2 converts its checkpoints (shared blocks aliased); when its model cannot stay on the meta device the
    converted tensors are matched before it is built for real, so vocab_size 1e9 never allocates 256 GB."""
    from hybridcache.models.families.zamba2 import Zamba2LM

    directory = tmp_path / "zamba2"
    shutil.copytree(checkpoints("zamba2"), directory)
    init = Zamba2LM.__init__
    built = []

    def with_plain_tensor(self, config):
        init(self, config)
        self.offsets = torch.ones(3)  # on the meta device it would never get values: built for real
        built.append(self.offsets.is_meta)

    monkeypatch.setattr(Zamba2LM, "__init__", with_plain_tensor)
    hc.from_pretrained(directory)
    assert built == [True, False]
    write_config(directory, lambda c: c.update(vocab_size=10**9))
    with pytest.raises(hc.models.CheckpointError, match=r"embed_tokens.weight has shape \(384, 64\)"):
        hc.from_pretrained(directory)
    assert built[-1] is True  # refused from the meta build, never built for real


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dtype": torch.int8}, "dtype must be one of"),
        ({"dtype": "float32"}, "dtype must be one of"),
        ({"dtype": torch.complex64}, "dtype must be one of"),
        ({"device": "nodevice"}, "device 'nodevice' is not a device"),
    ],
)
def test_dtype_and_device_are_checked_before_reading(gemma_dir, monkeypatch, kwargs, message):
    import hybridcache.models.core.loading as loading

    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("tensors read before the check"))
    with pytest.raises(ValueError, match=message):
        hc.from_pretrained(gemma_dir, **kwargs)


def test_weights_are_read_into_memory_of_their_own(gemma_dir, models):
    """Read, not memory-mapped (file-backed pages stream slower): the file can go once the model is loaded."""
    model = hc.from_pretrained(gemma_dir, decode_kernel=False)
    ids = prompts(1, 6, seed=2)
    before = model(ids)
    (gemma_dir / "model.safetensors").write_bytes(b"")  # no mapping may still read from it
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def test_a_truncated_file_is_refused_before_anything_is_read(gemma_dir):
    path = gemma_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(hc.models.CheckpointError, match="model.safetensors is not a readable safetensors file"):
        hc.from_pretrained(gemma_dir)

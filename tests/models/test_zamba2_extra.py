"""Zamba2 beyond the parity suite: shared blocks stored once (each use with its own KV cache), checkpoints that
repeat a shared block under every layer's name, and the dt clamp (time_step_min) that HF applies only in
multi-token forwards."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hybridcache as hc
from hybridcache.checkpoints.tiny import build_tiny_checkpoint
from hybridcache.models import CheckpointError
from tests.models.conftest import prompts


def test_shared_blocks_are_stored_once_with_a_kv_cache_per_use(models):
    ours, _ = models("zamba2")
    layers = ours.model.layers
    assert layers[4]._shared[0] is layers[1].shared_transformer  # uses 0 and 2 run block 0
    assert layers[3]._shared[0] is not layers[1].shared_transformer
    names = ours.state_dict().keys()
    assert not any(n.startswith("model.layers.4.shared_transformer") for n in names)
    assert "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.0.weight" in names  # use 2's adapter
    cache = ours.make_cache(1)
    ours(prompts(1, 5, seed=0), cache)
    a, b = cache[1].attention, cache[4].attention
    assert a is not b and not torch.equal(a.keys, b.keys)


def _copy_checkpoint(src, dst, state):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_block_repeated_under_every_name_is_aliased_and_must_be_identical(checkpoints, models, tmp_path):
    ours, _ = models("zamba2")
    src = checkpoints("zamba2")
    state = load_file(str(src / "model.safetensors"))
    first, later = "model.layers.1.shared_transformer.", "model.layers.4.shared_transformer."
    repeated = {**state, **{later + k[len(first) :]: v.clone() for k, v in state.items() if k.startswith(first)}}
    model = hc.from_pretrained(_copy_checkpoint(src, tmp_path / "repeated", repeated))
    ids = prompts(1, 12, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids), ours(ids))
    repeated[later + "feed_forward.down_proj.weight"] += 1e-3
    with pytest.raises(CheckpointError, match="share one block"):
        hc.from_pretrained(_copy_checkpoint(src, tmp_path / "different", repeated))


@pytest.fixture(scope="module")
def clamped(tmp_path_factory):
    """The tiny zamba2 with HF's default time_step_min (0.001), where dt reaches the clamp."""
    path = build_tiny_checkpoint("zamba2", tmp_path_factory.mktemp("zamba2_clamp"), time_step_min=0.001)
    assert json.loads((path / "config.json").read_text())["time_step_min"] == 0.001
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    return hc.from_pretrained(path), hc.from_pretrained(path, dtype=torch.float64), ref


def test_dt_clamp_is_applied_in_every_block(clamped):
    """Ours clamps in prefill and decode alike (any split gives the same logits: exact in float64) and matches HF's
    prefill, which clamps; HF's decode step does not clamp, so its cached logits drift from its own full forward."""
    ours, ours64, ref = clamped
    ids = prompts(1, 24, seed=2)
    with torch.no_grad():
        full_ref = ref(ids).logits
        assert (ours(ids) - full_ref).abs().max().item() <= 1e-4
    f64 = {"recurrent": {"state_dtype": torch.float64}}
    one = hc.generate(ours64, ids[:, :12], max_new_tokens=4, cache_config=f64)
    stepped = hc.generate(ours64, ids[:, :12], max_new_tokens=4, cache_config=f64, prefill_chunk_size=1)
    assert torch.equal(one.sequences, stepped.sequences)
    assert (one.logits - stepped.logits).abs().max().item() <= 1e-9
    with torch.no_grad():  # HF: prefill 12 tokens, then feed the other 12 one at a time
        out = ref(ids[:, :12], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(12, 24):
            out = ref(ids[:, t : t + 1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[t]]))
            steps.append(out.logits[:, -1])
    hf_drift = (torch.stack(steps, 1) - full_ref[:, 12:]).abs().max().item()
    assert hf_drift > 1e-3, "HF's decode now clamps dt like its prefill: the tiny checkpoint can keep the default"

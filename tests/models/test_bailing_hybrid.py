"""Bailing-hybrid variants the tiny checkpoint does not cover, against HF transformers (float32): Kimi's softplus
forget gate (kda_safe_gate False), low-rank queries, values narrower than the MLA keys; Ling's own checkpoint layout
(packed q/k/v conv, multi-token-prediction layers after the decoder); the layer pattern from layer_group_size."""

import json

import safetensors.torch
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import build_tiny_checkpoint
from hybridcache.models.families.bailing_hybrid import BailingHybridConfig
from tests.models.conftest import hf_generate, prompts


def test_softplus_gate_low_rank_queries_narrow_values_match_hf(tmp_path):
    path = build_tiny_checkpoint("bailing_hybrid", tmp_path, kda_safe_gate=False, q_lora_rank=32, v_head_dim=32)
    ours = hc.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = prompts(1, 13, seed=3)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    out = hc.generate(ours, ids, max_new_tokens=8)
    sequences, logits = hf_generate(ref.eval(), ids, None, 8)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4


def test_packed_conv_and_mtp_layers_load_as_hf(tmp_path):
    path = build_tiny_checkpoint("bailing_hybrid", tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = safetensors.torch.load_file(path / "model.safetensors")
    for name in [k for k in state if k.endswith(".q_conv1d.weight")]:  # HF's packed runtime layout
        parts = [state.pop(name.replace("q_conv1d", p)) for p in ("q_conv1d", "k_conv1d", "v_conv1d")]
        state[name.replace("q_conv1d", "conv1d")] = torch.cat(parts)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    state[f"model.layers.{layers}.mlp.gate_proj.weight"] = torch.ones(3, 3)  # an MTP layer: not part of the model
    safetensors.torch.save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    ours = hc.from_pretrained(path, dtype=torch.float32)
    ids = prompts(2, 9, seed=5)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_layer_pattern_from_group_size():
    raw = dict(vocab_size=384, hidden_size=64, num_hidden_layers=7, layer_group_size=3, first_k_dense_replace=2)
    raw |= dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16, short_conv_kernel_size=3)
    cfg = BailingHybridConfig.from_hf(raw)
    hf = transformers.BailingHybridConfig(**raw)
    assert cfg.layer_types == hf.layer_types
    assert cfg.layer_types.count("full_attention") == 2 and cfg.layer_types[2] == "full_attention"
    assert cfg.mlp_layer_types == hf.mlp_layer_types == ["dense"] * 2 + ["sparse"] * 5
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (16, 2, 3)

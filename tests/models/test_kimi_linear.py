"""Kimi Linear variants the tiny checkpoint does not cover, against HF transformers (float32): values wider than
the MLA keys (queries and keys padded in the cache instead of values), full-rank q_proj, ungrouped routing; and the
original checkpoints' config layout (`linear_attn_config`, 1-based layer lists, `first_k_dense_replace`)."""

import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import build_tiny_checkpoint
from hybridcache.models.families.kimi_linear import KimiLinearConfig
from tests.models.conftest import hf_generate, prompts


def test_wide_values_full_rank_queries_match_hf(tmp_path):
    path = build_tiny_checkpoint(
        "kimi_linear", tmp_path, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=48, n_group=1
    )
    ours = hc.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ids = prompts(1, 13, seed=3)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    out = hc.generate(ours, ids, max_new_tokens=8)
    sequences, logits = hf_generate(ref.eval(), ids, None, 8)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4


def test_original_config_layout():
    raw = dict(
        vocab_size=384,
        hidden_size=64,
        num_hidden_layers=5,
        first_k_dense_replace=2,
        linear_attn_config={"head_dim": 16, "num_heads": 3, "short_conv_kernel_size": 3, "full_attn_layers": [2, 5]}
        | {"kda_layers": [1, 3, 4]},
    )
    cfg = KimiLinearConfig.from_hf(raw)
    assert cfg.layer_types == ["linear_attention", "full_attention", "linear_attention", "linear_attention"] + [
        "full_attention"
    ]
    assert cfg.mlp_layer_types == ["dense", "dense", "sparse", "sparse", "sparse"]
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (16, 3, 3)
    hf = transformers.KimiLinearConfig(**raw)
    assert hf.layer_types == cfg.layer_types and hf.mlp_layer_types == cfg.mlp_layer_types

"""Variants of LFM2, Nemotron-H and Granite 4.0 hybrid that their default tiny checkpoints do not cover, against HF.

- lfm2: tied embeddings, the feed-forward width as given (block_auto_adjust_ff_dim false), attention first;
- nemotron_h: a legacy config.json (hybrid_override_pattern, mamba_* names), an MLP layer before the first mixer
  (it joins the first cache entry), group-limited routing (3 groups, 2 kept), a latent MoE projection, a non-zero
  score-correction bias, and an `mtp.*` tensor that loading drops (as HF does);
- granitemoehybrid: dense (no experts), no positional embedding, tied embeddings (multipliers applied at run
  time, not folded), legacy layer type names.
Each is compared with HF on a forward pass and on greedy generation from a left-padded batch, and with our own
recompute oracle in float64.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hybridcache as hc
from hybridcache.checkpoints.tiny import build_tiny_checkpoint
from tests.models.conftest import hf_generate, prompts


def _legacy_nemotron(path):
    config = json.loads((path / "config.json").read_text())
    pattern = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    config["hybrid_override_pattern"] = "".join(pattern[t] for t in config.pop("layers_block_type"))
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    for new, old in [
        ("n_groups", "mamba_n_groups"),
        ("conv_kernel", "mamba_d_conv"),
        ("chunk_size", "mamba_chunk_size"),
        ("use_conv_bias", "mamba_conv_bias"),
        ("time_step_min", "mamba_dt_min"),
    ]:
        config[old] = config.pop(new)
    (path / "config.json").write_text(json.dumps(config))
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    for name in state:
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.randn(state[name].shape, generator=gen) * 0.1
    state["mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _legacy_granite(path):
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = [
        {"linear_attention": "mamba", "full_attention": "attention"}[t] for t in config["layer_types"]
    ]
    (path / "config.json").write_text(json.dumps(config))


VARIANTS = {
    "lfm2": (
        "lfm2",
        dict(
            tie_word_embeddings=True,
            block_auto_adjust_ff_dim=False,
            layer_types=["full_attention", "conv", "conv", "full_attention"],
        ),
        None,
    ),
    "nemotron_h": (
        "nemotron_h",
        dict(
            layers_block_type=["mlp", "linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
            n_routed_experts=6,
            n_group=3,
            topk_group=2,
            num_experts_per_tok=3,
            moe_latent_size=32,
        ),
        _legacy_nemotron,
    ),
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=True),
        _legacy_granite,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides, edit = VARIANTS[request.param]
    path = build_tiny_checkpoint(family, tmp_path_factory.mktemp(request.param), seed=3, **overrides)
    if edit is not None:
        edit(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return request.param, path, hc.from_pretrained(path), ref.eval()


def _padded_batch():
    ids = prompts(2, 17, seed=21)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    return ids, mask


def test_variant_config_is_what_it_claims(variant):
    name, _, ours, _ = variant
    if name == "nemotron_h":
        assert ours.types[0] == "mlp" and ours.runs[0] == [0, 1, 2] and len(ours.native_layers()) == 3
        assert ours.cfg.n_group == 3 and ours.backbone.layers[2].mixer.fc1_latent_proj is not None
    elif name == "granitemoehybrid":
        assert ours.runtime_scales and ours.model.layers[0].block_sparse_moe is None
        assert ours.lm_head.weight is ours.model.embed_tokens.weight and ours.types[1] == "full_attention"
        assert ours.model.layers[1].self_attn.rotary is None
    else:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
        assert ours.model.layers[0].feed_forward.up_proj.out_features == 256  # intermediate_size as given


def test_variant_forward_and_padded_greedy_match_hf(variant):
    _, _, ours, ref = variant
    ids = prompts(1, 21, seed=20)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    ids, mask = _padded_batch()
    out = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
    sequences, logits = hf_generate(ref, ids, mask, 12)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4


def test_variant_cached_equals_recompute_in_float64(variant):
    _, path, _, _ = variant
    ours = hc.from_pretrained(path, dtype=torch.float64)
    ids, mask = _padded_batch()
    states = {"recurrent": {"state_dtype": torch.float64}}
    cached = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=8, cache_config=states, prefill_chunk_size=5)
    oracle = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=8, cache_config=states, use_cache=False)
    assert torch.equal(cached.sequences, oracle.sequences)
    assert (cached.logits - oracle.logits).abs().max().item() <= 1e-9

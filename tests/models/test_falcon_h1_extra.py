"""Falcon-H1 variants beyond the tiny checkpoint of the parity suite, against HF transformers: tied embeddings (the
embedding and LM-head multipliers then stay at runtime), every bias on (multipliers folded into biases too), the
plain z-gate instead of the gated RMSNorm; and the folding itself (weights differ from the checkpoint's)."""

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hybridcache as hc
from hybridcache.checkpoints.tiny import build_tiny_checkpoint
from tests.models.conftest import hf_generate, prompts

VARIANT = dict(
    tie_word_embeddings=True,
    attention_bias=True,
    mlp_bias=True,
    mamba_proj_bias=True,
    projectors_bias=True,
    mamba_rms_norm=False,
)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    path = build_tiny_checkpoint("falcon_h1", tmp_path_factory.mktemp("falcon_h1_variant"), seed=3, **VARIANT)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    return path, hc.from_pretrained(path), ref


def test_variant_matches_hf(variant):
    _, ours, ref = variant
    assert ours.embedding_scale == 1.5 and ours.logit_scale == 0.75  # tied: applied at runtime
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = prompts(1, 21, seed=1)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    out = hc.generate(ours, ids, max_new_tokens=16)
    sequences, logits = hf_generate(ref, ids, None, 16)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4


def test_multipliers_are_folded_into_the_weights(variant):
    path, ours, _ = variant
    raw = load_file(str(path / "model.safetensors"))
    layer = ours.model.layers[0]
    p = "model.layers.0."
    torch.testing.assert_close(layer.self_attn.k_proj.weight, raw[p + "self_attn.k_proj.weight"] * (0.9 * 1.3))
    torch.testing.assert_close(layer.self_attn.k_proj.bias, raw[p + "self_attn.k_proj.bias"] * 1.3)
    torch.testing.assert_close(layer.self_attn.q_proj.bias, raw[p + "self_attn.q_proj.bias"])  # input scale only
    torch.testing.assert_close(layer.feed_forward.down_proj.bias, raw[p + "feed_forward.down_proj.bias"] * 1.25)
    w, b = raw[p + "mamba.in_proj.weight"], raw[p + "mamba.in_proj.bias"]
    dt_rows = slice(w.shape[0] - 6, None)  # the last 6 rows (one per head) give dt: ssm_multipliers[4] = 1.3
    torch.testing.assert_close(layer.mamba.in_proj.weight[dt_rows], w[dt_rows] * (1.3 * 1.2))
    torch.testing.assert_close(layer.mamba.in_proj.bias[:96], b[:96] * 1.1)  # z rows: ssm_multipliers[0]
    torch.testing.assert_close(ours.model.embed_tokens.weight, raw["model.embed_tokens.weight"])  # tied: not folded

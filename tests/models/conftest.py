"""Tiny checkpoints (built once per test session, fixed seeds) loaded into our models and HF transformers."""

import os

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.tiny_models import tiny_checkpoint


def prompts(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [B, T] (avoiding the pad/eos/unk ids 0-2)."""
    return torch.randint(3, 384, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_generate(ref, ids, mask, new_tokens):
    """HF greedy generation without eos stopping (like ours without eos_token_id): sequences, raw logits [B, T_new, V].

    Not min_new_tokens: it bans eos from the argmax, so a step where eos wins would differ by construction."""
    out = ref.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences.shape[1] == ids.shape[1] + new_tokens
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    home = os.environ.get("HYBRIDCACHE_TEST_HOME") or str(tmp_path_factory.mktemp("hybridcache_home"))
    os.environ["HYBRIDCACHE_HOME"] = home
    return lambda family: tiny_checkpoint(family)


@pytest.fixture(scope="session")
def models(checkpoints):
    """models(family) -> (our model, the HF model) in float32; models(family, torch.float64) -> (ours, None)."""
    loaded = {}

    def get(family, dtype=torch.float32):
        if (family, dtype) not in loaded:
            path = checkpoints(family)
            ref = None
            if dtype == torch.float32:
                ref = transformers.AutoModelForCausalLM.from_pretrained(
                    path, attn_implementation="eager", dtype=torch.float32
                ).eval()
            loaded[family, dtype] = (hc.from_pretrained(path, dtype=dtype), ref)
        return loaded[family, dtype]

    return get

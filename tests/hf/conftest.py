"""Tiny checkpoints for the bridge's tests: HF's own classes for every family (hybridcache.hf.tiny_hf), and the
saved tiny checkpoints of the families hybridcache implements (loaded by HF and by us from the same files)."""

import os

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.hf.tiny_hf import tiny_model

NEW = 8  # new tokens per generation


def prompts(batch: int, length: int, seed: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, T] (no pad / eos / unk ids) and a mask whose row 0 starts with `pad` padding tokens."""
    ids = torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return ids, mask


def hf_kwargs(new: int = NEW, **kw):
    """HF generate settings: greedy unless told, no eos stopping (eos_token_id=None rather than min_new_tokens, which
    bans eos from the argmax), raw logits."""
    settings = dict(
        max_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    settings.update(kw)
    return settings


@torch.no_grad()
def hf_generate(model, ids, mask, cache=None, new: int = NEW, **kw):
    """(sequences [B, T + new], logits [B, new, V]) of HF's generate, with `cache` if given."""
    extra = {} if cache is None else {"cache": cache}
    out = model.generate(ids, attention_mask=mask, **hf_kwargs(new, **kw), **extra)
    return out.sequences, torch.stack(out.logits, dim=1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    path = os.environ.get("HYBRIDCACHE_TEST_HOME") or str(tmp_path_factory.mktemp("hybridcache_home"))
    os.environ["HYBRIDCACHE_HOME"] = path
    return path


@pytest.fixture(scope="session")
def pair(home):
    """pair(family) -> (HF's model, ours), both loaded once from the same saved tiny checkpoint, float32 (the bridge
    installs itself on the HF model once; every test builds its own caches)."""
    loaded: dict[str, tuple] = {}

    def get(family: str):
        if family not in loaded:
            path = tiny_checkpoint(family)
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            loaded[family] = hf, hc.from_pretrained(path, dtype=torch.float32)
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def hf_tiny():
    """hf_tiny(model_type) -> a fresh tiny HF model built with HF's own classes (seeded)."""
    return lambda model_type, **overrides: tiny_model(model_type, **overrides)

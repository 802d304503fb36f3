"""Tiny checkpoints (built once per test session, fixed seeds) loaded into our models and HF transformers."""

import os

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import tiny_checkpoint


def prompts(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [B, T] (avoiding the pad/eos/unk ids 0-2)."""
    return torch.randint(3, 384, (batch, length), generator=torch.Generator().manual_seed(seed))


def without_recurrent_steps(model, monkeypatch=None) -> None:
    """Drop the recurrent mixers' one-call decode steps (accel/mixers/recurrent.py) from `model`: they sum in another
    order than the reference modules and the compiled graph (float32 noise: tests/models/test_recurrent_accel.py),
    where a test checks a route for the same bits as another. With `monkeypatch`, undone after the test (a shared
    model)."""
    from hybridcache.accel.mixers.recurrent import GatedDeltaAccel, Mamba2Accel, MambaAccel, ShortConvAccel

    for m in model.modules():
        if isinstance(m.__dict__.get("accel"), (MambaAccel, Mamba2Accel, ShortConvAccel, GatedDeltaAccel)):
            if monkeypatch is None:
                m.accel = None
            else:
                monkeypatch.setattr(m, "accel", None)


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


def failed_step_changes_nothing(model, ids: torch.Tensor, failing) -> None:
    """Two tokens generated from `ids`, then a step under `failing` (a context in which it raises): the cache holds
    what it held (keys, positions, counts), and the next steps equal a fresh run's."""
    out = hc.generate(model, ids, max_new_tokens=2)
    before = [(e.keys.clone(), e.key_pos.clone(), e.seen.clone()) for e in out.cache.entries]
    with failing():  # (step by step: the step's own path fails, not a decode run's)
        hc.generate(model, out.sequences, max_new_tokens=1, cache=out.cache, decode_runs=False)
    for e, (keys, pos, seen) in zip(out.cache.entries, before, strict=True):
        assert torch.equal(e.keys, keys) and torch.equal(e.key_pos, pos) and torch.equal(e.seen, seen)
    again = hc.generate(model, out.sequences, max_new_tokens=3, cache=out.cache).logits
    fresh = hc.generate(model, ids, max_new_tokens=5).logits  # [B, T_new, V]
    assert torch.equal(again, fresh[:, 2:])


def left_padded(batch: int, length: int, seed: int, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts and a mask whose last row starts with `pad` padding tokens."""
    ids = prompts(batch, length, seed)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    return ids, mask


def generate_with_cache(model, ids: torch.Tensor, mask: torch.Tensor | None, new: int) -> tuple:
    """(sequences, logits, each cache layer's keys, values and key positions) of a greedy generation."""
    out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new)
    cache = [(e.keys.clone(), e.values.clone(), e.key_pos.clone()) for e in out.cache.entries]
    return out.sequences, out.logits, cache

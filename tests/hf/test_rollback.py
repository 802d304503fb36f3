"""(d) Recurrent rollback through our `rollback: k`, where HF has none: with `rollback: k` on recurrent layers,
HF's `cache.crop(-n)` rewinds every layer (states from the checkpoint trail, attention exactly) and decoding goes on
as if the cropped tokens had never been fed. HF's own cache cannot (its linear-attention layers refuse to crop once
they hold a recurrent state), and without rollback the bridge refuses by name."""

import pytest
import torch
from transformers import DynamicCache

from hybridcache.cache import CacheCropError
from hybridcache.hf import BridgeError, cache_for
from tests.hf.conftest import max_diff, prompts

TOL = 1e-4
FAMILIES = ["jamba", "bamba", "qwen3_next", "lfm2", "falcon_h1", "mamba2"]


@torch.no_grad()
def _decode(model, cache, ids, mask, tokens):
    """Feed `tokens` [B, n] one per forward after the cache's columns; the logits of each step [B, n, V]."""
    out = []
    for t in tokens.unbind(1):
        mask = torch.cat([mask, torch.ones_like(t[:, None])], 1)
        out.append(model(input_ids=t[:, None], attention_mask=mask, cache=cache).logits[:, -1])
    return torch.stack(out, 1), mask


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_rewinds_recurrent_states(pair, family):
    _check_crop(pair(family)[0])


@pytest.mark.parametrize("family", ["inkling_text", "zaya"])
def test_crop_rewinds_every_state_of_a_multi_state_layer(hf_tiny, family):
    """HF-only families with several states per layer (Inkling: four short convolutions; ZAYA: a conv state and the
    previous token's delayed value), each one member of a group (hybridcache/hf/layers/multi_state.py)."""
    hf = hf_tiny(family)
    members = {p.member for p in cache_for(hf).plan.layers if p.index == 0}
    assert len(members) >= 3, members  # attention and at least two states
    _check_crop(hf)


def _check_crop(hf):
    ids, mask = prompts(2, 6, seed=13, pad=2)
    wrong = torch.randint(3, 300, (2, 3), generator=torch.Generator().manual_seed(2))
    right = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(3))
    cache = cache_for(hf, {"recurrent": {"rollback": 4}})
    assert cache.is_croppable
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=cache)
    _, m = _decode(hf, cache, ids, mask, wrong)
    cache.crop(-3)  # HF's convention: drop the last 3 columns
    assert cache.get_seq_length() == ids.shape[1]
    logits, _ = _decode(hf, cache, ids, mask, right)
    ref = cache_for(hf)  # never saw the wrong tokens
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=ref)
    expected, _ = _decode(hf, ref, ids, mask, right)
    assert max_diff(logits, expected) < TOL
    wrong_way, _ = _decode(hf, cache_for(hf), ids, mask, torch.cat([wrong, right], 1))
    assert max_diff(wrong_way[:, 3:], expected) > 1e-2  # the cropped tokens did change the states


def test_without_rollback_crop_is_refused_by_name(pair):
    hf, _ = pair("jamba")
    ids, mask = prompts(1, 6, seed=14)
    cache = cache_for(hf)
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=cache)
    assert not cache.is_croppable
    with pytest.raises(CacheCropError, match="rollback"):
        cache.crop(-2)
    assert cache.get_seq_length() == 6  # unchanged
    with pytest.raises(BridgeError, match="negative"):
        cache.crop(2)


def test_hf_own_cache_cannot_crop_a_recurrent_state(pair):
    """What the bridge adds: HF's own linear-attention layers refuse crop without past recording."""
    hf, _ = pair("jamba")
    ids, mask = prompts(1, 6, seed=14)
    own = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=own)
    assert not own.is_croppable
    with pytest.raises(RuntimeError):
        own.crop(-2)

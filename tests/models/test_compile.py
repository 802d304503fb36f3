"""The compiled decode step (torch.compile over a preallocated cache) gives what eager decoding gives."""

import pytest
import torch

import hybridcache as hc
from tests.models.conftest import prompts
from tests.models.test_parity import SPLIT_TOL  # families that amplify float32 rounding differences (documented there)


@pytest.mark.parametrize("family", ["gemma3", "jamba", "bamba", "falcon_h1", "zamba2", "qwen3_next", "lfm2", "nemotron_h", "granitemoehybrid"])  # a sliding ring + full buffer; mamba states + full buffer
def test_compiled_decode_equals_eager(family, models):
    ours, _ = models(family)
    ids = prompts(2, 13, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
    compiled = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12, compile=True)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert (eager.logits - compiled.logits).abs().max().item() <= max(2e-5, SPLIT_TOL.get(family, 0.0))
    assert all(getattr(layer, "static", True) for layer in compiled.cache)  # attention layers preallocated


def test_compile_needs_the_cache(models):
    ours, _ = models("gemma3")
    with pytest.raises(ValueError, match="use_cache=False"):
        hc.generate(ours, prompts(1, 4, seed=0), compile=True, use_cache=False)

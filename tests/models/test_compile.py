"""The compiled decode step (torch.compile over a preallocated cache) gives what eager decoding gives."""

import pytest
import torch
from torch._dynamo.utils import counters

import hybridcache as hc
from tests.models.conftest import prompts
from tests.models.test_parity import SPLIT_TOL  # families that amplify float32 rounding differences (documented there)


@pytest.mark.parametrize(
    "family",
    [
        "gemma3",
        "gemma4",  # KV-shared readers: no cache entry, the writers' views
        "jamba",
        "bamba",
        "falcon_h1",
        "zamba2",
        "zamba",
        "qwen3_next",
        "lfm2",
        "nemotron_h",
        "granitemoehybrid",
        "qwen3_5",
        "lfm3",
        "kimi_linear",
        "bailing_hybrid",
        "granite_swa",  # learned attention sinks: decode by the torch path
        "gpt_oss",
        "olmo_hybrid",
        "glm5_next",
    ],
)  # a sliding ring + full buffer; mamba states + full buffer
def test_compiled_decode_equals_eager(family, models):
    ours, _ = models(family)
    ids = prompts(2, 13, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
    torch._dynamo.reset()  # compile here, counting graph breaks: one graph per step, or it falls back per layer
    counters.clear()
    compiled = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12, compile=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(eager.sequences, compiled.sequences)
    assert (eager.logits - compiled.logits).abs().max().item() <= max(2e-5, SPLIT_TOL.get(family, 0.0))
    assert all(getattr(layer, "static", True) for layer in compiled.cache)  # attention layers preallocated


def test_compile_needs_the_cache(models):
    ours, _ = models("gemma3")
    with pytest.raises(ValueError, match="use_cache=False"):
        hc.generate(ours, prompts(1, 4, seed=0), compile=True, use_cache=False)


def test_compiled_projection_keeps_autograd():
    """Under torch.compile with autograd on, a projection takes the differentiable torch path (the decode kernel's
    op has no backward): gradients equal those of nn.Linear."""
    from hybridcache.nn.core.linear import DecodeLinear

    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 4)
    fast = DecodeLinear(8, 4)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(2, 8, requires_grad=True)
    compiled = torch.compile(lambda t: fast(t).square().sum(), backend="aot_eager")
    compiled(x).backward()
    x_ref = x.detach().clone().requires_grad_(True)
    plain(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(fast.weight.grad, plain.weight.grad)

"""The sparse MoE block's fast path (accel/mixers/moe.py): a decode step runs only the routed experts, with the same
bits as
the reference block (which runs every expert in its dense form) at batch 1 (the routed form) and batch 2 (the dense
form), on every family whose MoE routes through SparseMoE.forward; a prefill of more than 16 tokens keeps the
reference."""

import pytest
import torch

import hybridcache as hc
from hybridcache.accel.mixers.moe import SparseMoEAccel
from hybridcache.nn.core.mlp import GatedMLP
from tests.models.conftest import prompts

FAMILIES = ["jamba", "qwen3_next", "kimi_linear", "bailing_hybrid", "glm5_next"]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_routed_experts_only_same_bits(family, batch, checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints(family))
    blocks = [m for m in model.modules() if isinstance(m.__dict__.get("accel"), SparseMoEAccel)]
    assert blocks
    calls = {"experts": 0, "taken": 0}
    real_mlp, real_accel = GatedMLP.forward, SparseMoEAccel.__call__

    def counted_mlp(self, x):
        calls["experts"] += 1
        return real_mlp(self, x)

    def counted_accel(self, h):
        out = real_accel(self, h)
        calls["taken"] += out is not None
        return out

    monkeypatch.setattr(GatedMLP, "forward", counted_mlp)
    monkeypatch.setattr(SparseMoEAccel, "__call__", counted_accel)
    ids = prompts(batch, 9, seed=5)
    fast = hc.generate(model, ids, max_new_tokens=8)
    fast_calls = dict(calls)
    for m in blocks:
        m.accel = None
    calls.update(experts=0, taken=0)
    ref = hc.generate(model, ids, max_new_tokens=8)
    assert torch.equal(fast.sequences, ref.sequences) and torch.equal(fast.logits, ref.logits)
    # every decode step of every block (and a prefill of at most 16 tokens: batch 1 here; the dense form)
    assert fast_calls["taken"] == len(blocks) * (8 if batch == 1 else 7)
    assert fast_calls["experts"] <= calls["experts"]  # never more expert calls than the reference

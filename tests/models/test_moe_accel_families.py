"""The one-token fast path of the MoE blocks outside SparseMoE (accel/mixers/moe.py): Granite's stacked experts,
Nemotron-H's
latent MoE, Llama4's MoE and Gemma 4's experts run a decode token's routed experts without the reference's
per-expert search, with the same bits as the reference blocks (the same tokens and bit-identical logits); batch 2 and
the prefill keep the reference. GPT-OSS's experts run in one C call: float32 noise, the same tokens."""

import pytest
import torch

import hybridcache as hc
from hybridcache.accel.mixers.moe import (
    Gemma4ExpertsAccel,
    LatentExpertsAccel,
    Llama4MoEAccel,
    OssExpertsAccel,
    RoutedExpertsAccel,
)
from tests.models.conftest import prompts

FAST = (RoutedExpertsAccel, LatentExpertsAccel, Llama4MoEAccel, Gemma4ExpertsAccel)
NEW = 8
# the tiny Nemotron-H has no MoE layer: this variant of it has two (its experts' config is the tiny one's)
NEMOTRON_MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp"])


def _path(family: str, checkpoints, tmp_path):
    if family != "nemotron_h_moe":
        return checkpoints(family)
    from hybridcache.checkpoints.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("nemotron_h", tmp_path / family, **NEMOTRON_MOE)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h_moe", "llama4", "gemma4"])
def test_one_token_experts_same_bits(family, batch, checkpoints, monkeypatch, tmp_path):
    model = hc.from_pretrained(_path(family, checkpoints, tmp_path))
    blocks = [m for m in model.modules() if isinstance(m.__dict__.get("accel"), FAST)]
    assert blocks, f"{family}: no MoE block got the fast path"
    taken = {"n": 0}
    for cls in FAST:
        real = cls.__call__

        def counted(self, *args, _real=real):
            out = _real(self, *args)
            taken["n"] += out is not None
            return out

        monkeypatch.setattr(cls, "__call__", counted)
    ids = prompts(batch, 9, seed=6)
    fast = hc.generate(model, ids, max_new_tokens=NEW)
    for m in blocks:
        m.accel = None
    ref = hc.generate(model, ids, max_new_tokens=NEW)
    assert torch.equal(fast.sequences, ref.sequences) and torch.equal(fast.logits, ref.logits)
    assert taken["n"] == (len(blocks) * (NEW - 1) if batch == 1 else 0)  # every decode token at batch 1 only


def test_gpt_oss_experts_in_one_call_keep_the_tokens(checkpoints, monkeypatch):
    """GPT-OSS's MoE: a decode token's experts in one C call: float32 noise, the same tokens as the reference."""
    model = hc.from_pretrained(checkpoints("gpt_oss"))
    blocks = [m for m in model.modules() if isinstance(m.__dict__.get("accel"), OssExpertsAccel)]
    assert blocks
    taken, real = {"n": 0}, OssExpertsAccel.__call__

    def counted(self, h):
        out = real(self, h)
        taken["n"] += out is not None
        return out

    monkeypatch.setattr(OssExpertsAccel, "__call__", counted)
    ids = prompts(1, 9, seed=7)
    fast = hc.generate(model, ids, max_new_tokens=NEW)
    assert taken["n"] == len(blocks) * (NEW - 1)
    for m in blocks:
        m.accel = None
    ref = hc.generate(model, ids, max_new_tokens=NEW)
    assert torch.equal(fast.sequences, ref.sequences)
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-4, atol=1e-4)

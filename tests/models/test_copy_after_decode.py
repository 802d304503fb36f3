"""A model that has decoded (its fast paths hold bound kernel calls pointing at its weights) can be deep-copied and
pickled, and the copy's fast paths read the copy's own weights: after the copy's weights change, its logits follow
them (equal to the copy's reference modules, every accel removed), and the original's do not move. A copy's logits
are the original's within float32 noise, not bit for bit: a copy binds its kernels afresh and may take another
route for a step than the original did (measured: up to 4e-6 on the tiny checkpoints)."""

import copy
import pickle

import pytest
import torch

import hybridcache as hc
from hybridcache.checkpoints.tiny import FAMILIES, tiny_checkpoint
from tests.models.conftest import prompts


def _logits(model, ids):
    return hc.generate(model, ids, max_new_tokens=4, do_sample=False).logits


def _without_accels(model):
    for m in model.modules():
        if "accel" in m.__dict__:
            m.accel = None
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoded_model_copies_and_its_copy_binds_its_own_weights(family):
    model = hc.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
    ids = prompts(1, 7, seed=5)
    before = _logits(model, ids)  # binds the fast paths to the original's weights
    twin = copy.deepcopy(model)
    torch.testing.assert_close(_logits(twin, ids), before, atol=1e-4, rtol=1e-4)  # float32 noise: see below
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.0625)  # in place: the same tensors' values change
    changed = _logits(twin, ids)
    reference = _logits(_without_accels(copy.deepcopy(twin)), ids)
    torch.testing.assert_close(changed, reference, atol=1e-4, rtol=1e-4)  # float32 noise of the fast paths
    assert not torch.allclose(changed, before, atol=1e-3)
    assert torch.equal(_logits(model, ids), before)
    restored = pickle.loads(pickle.dumps(twin))
    torch.testing.assert_close(_logits(restored, ids), changed, atol=1e-5, rtol=1e-5)

"""The recurrent mixers' one-call decode steps in whole models (accel/mixers/recurrent.py, delta_mixers.py): every
Mamba1 (Zamba's grouped one too), Mamba2, short conv, Gated DeltaNet (Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's), KDA
(Kimi's, Bailing's, GLM-5-Next's) and RG-LRU mixer of the tiny checkpoints takes its decode steps in one C call,
the greedy tokens equal those of the reference modules (`accel.uninstall`) and of HF transformers, and the logits
and the cache's states stay within float32 noise of both (Mamba2 amplifies ulp-level differences ~10x: 1e-4 on
logits of order 1)."""

import pytest
import torch

import hybridcache as hc
from hybridcache import accel
from hybridcache.accel import kernel_status
from hybridcache.accel.layers.pre_norm import _Kept
from hybridcache.accel.mixers.delta import DeltaAccel
from hybridcache.accel.mixers.recurrent import (
    GatedDeltaAccel,
    Mamba2Accel,
    MambaAccel,
    MambaGroupsAccel,
    RGLRUAccel,
    ShortConvAccel,
)
from tests.models.conftest import hf_generate, prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

FAMILIES = [
    "lfm2",
    "lfm3",
    "bamba",
    "falcon_h1",
    "zamba2",
    "nemotron_h",
    "granitemoehybrid",
    "mamba2",
    "jamba",
    "mamba",
    "qwen3_next",
    "qwen3_5",
    "olmo_hybrid",
    "kimi_linear",
    "bailing_hybrid",
    "recurrentgemma",
    "zamba",
    "glm5_next",
]
FAST = (Mamba2Accel, MambaAccel, ShortConvAccel, GatedDeltaAccel, DeltaAccel, RGLRUAccel, MambaGroupsAccel)
NEW = 12


def _count_taken(monkeypatch) -> dict:
    """Counts of the mixers' one-call steps taken and declined (`prepare` where a mixer has it: what its own call and
    a many-layer step's record (accel/layers/pre_norm.py) both ask; else its call)."""
    taken = {"taken": 0, "declined": 0}
    for cls in FAST:
        name = "prepare" if hasattr(cls, "prepare") else "__call__"
        real = getattr(cls, name)

        def counted(self, *a, _real=real):
            out = _real(self, *a)
            taken["taken" if out is not None else "declined"] += 1
            return out

        monkeypatch.setattr(cls, name, counted)
    real_kept = _Kept.step

    def kept(self, *a):  # a kept record's later steps (steady decoding) skip `prepare`: their one-call steps
        out = real_kept(self, *a)
        taken["taken"] += out is not None
        return out

    monkeypatch.setattr(_Kept, "step", kept)
    return taken


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_steps_keep_the_tokens(family, checkpoints, monkeypatch):
    import transformers

    path = checkpoints(family)
    model = hc.from_pretrained(path)
    mixers = [m for m in model.modules() if isinstance(m.__dict__.get("accel"), FAST)]
    assert mixers, f"{family}: no recurrent mixer got the one-call step"
    taken = _count_taken(monkeypatch)
    ids = prompts(2, 9, seed=3)
    fast = hc.generate(model, ids, max_new_tokens=NEW)
    # every mixer: one prefill (the reference) and NEW - 1 decode steps (one C call each)
    assert taken == {"taken": len(mixers) * (NEW - 1), "declined": len(mixers)}
    accel.uninstall(model)
    ref = hc.generate(model, ids, max_new_tokens=NEW)
    assert torch.equal(fast.sequences, ref.sequences)
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-4, atol=1e-4)
    held = [(a, b) for a, b in zip(fast.cache.layers, ref.cache.layers, strict=True) if a.kind == "recurrent"]
    assert held
    for a, b in held:
        for name, state in a.states.items():
            torch.testing.assert_close(state, b.states[name], rtol=1e-4, atol=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_ids, hf_logits = hf_generate(hf, ids, torch.ones_like(ids), NEW)
    assert torch.equal(fast.sequences, hf_ids)
    torch.testing.assert_close(fast.logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_padding_and_autograd_go_to_the_reference(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("bamba"))
    taken = _count_taken(monkeypatch)
    ids = prompts(2, 6, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the prefill has padding; decode steps do not
    out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=4)
    assert taken["taken"] > 0
    accel.uninstall(model)
    ref = hc.generate(model, ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(out.sequences, ref.sequences)
    fresh = hc.from_pretrained(checkpoints("bamba"))
    mixer = next(m for m in fresh.modules() if isinstance(m.__dict__.get("accel"), Mamba2Accel))
    with torch.enable_grad():
        assert mixer.accel(torch.randn(1, 1, mixer.in_proj.in_features), None, None) is None

"""experiments/study/state_control.py, the control each trained recurrent model reports: its bits/byte with its
recurrent
states dropped after every byte, read through our model, against HF's Bamba fed one byte per call with its own
cache's states zeroed in place after each call (the independent oracle)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import hybridcache as hc
from experiments.study.state_control import has_recurrent_layers, state_controls
from experiments.train.data import windows
from experiments.train.model import hf_config, mamba_ssm_init

SIZE = dict(
    hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=48, attention_every=2, mamba_heads=2,
    state=8, chunk=16, max_positions=256,
)  # fmt: skip
LENGTH, COUNT = 24, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random M A Bamba whose states remember (the Mamba2 reference's init), exported as experiment=train does."""
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(hf_config("hybrid", SIZE)).eval()
    mamba_ssm_init(model, seed=0)
    with torch.no_grad():  # at HF's init scale a Mamba2 state moves the logits by ~1e-7: make it carry something
        for mixer in (m for m in model.modules() if hasattr(m, "dt_bias")):
            mixer.in_proj.weight.mul_(8)
            mixer.D.zero_()  # no skip: the mixer's output is its state's
            mixer.out_proj.weight.mul_(100)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    return model, path


@torch.no_grad()
def hf_bits(model, rows, zero_ssm: bool, zero_conv: bool) -> float:
    """HF's Bamba, one byte per call through its own DynamicCache, its Mamba2 states zeroed after each call."""
    ids, targets = rows[:, :-1], rows[:, 1:]
    cache, nll = None, 0.0
    for t in range(ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                for part in (layer.recurrent_states if zero_ssm else {}).values():
                    part.zero_()
                for part in (layer.conv_states if zero_conv else {}).values():
                    part.zero_()
        nll += F.cross_entropy(out.logits[:, 0].float(), targets[:, t], reduction="sum").item()
    return nll / targets.numel() / math.log(2)


def test_each_control_equals_hf_with_its_states_zeroed_in_place(checkpoint):
    model, path = checkpoint
    ours = hc.from_pretrained(path, dtype=torch.float32)
    assert has_recurrent_layers(ours)
    tokens = np.random.default_rng(1).integers(3, 259, size=COUNT * LENGTH + 1).astype(np.uint16)
    got = state_controls(ours, {"x": tokens}, LENGTH, COUNT)["x"]
    rows = torch.from_numpy(windows(tokens, LENGTH, COUNT))
    with torch.no_grad():  # native: the whole window in one call, no cache at all
        logits = model(input_ids=rows[:, :-1]).logits
    whole = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item() / math.log(2)
    assert got["native"] == pytest.approx(whole, abs=1e-5)
    assert got["ssm_zeroed"] == pytest.approx(hf_bits(model, rows, True, False), rel=1e-5)
    assert got["states_zeroed"] == pytest.approx(hf_bits(model, rows, True, True), rel=1e-5)
    # the controls are not native in disguise: dropping the states changes what the model predicts
    assert abs(got["ssm_zeroed"] - got["native"]) > 1e-4 and abs(got["states_zeroed"] - got["ssm_zeroed"]) > 1e-4


def test_a_model_without_recurrent_layers_has_no_control(tmp_path):
    cfg = hf_config("attention", SIZE)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path)
    assert not has_recurrent_layers(hc.from_pretrained(tmp_path, dtype=torch.float32))

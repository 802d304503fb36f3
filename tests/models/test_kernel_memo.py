"""Bound kernel calls (accel/kernel_memo.py): a decode step's fused kernels bound once to a layer's weights and
norms must follow every change of them, so the memo's result is always the result of binding afresh."""

import copy
import pickle

import pytest
import torch
from torch import nn

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.kernel_memo import KernelMemo
from tests.models.conftest import prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def test_a_memo_binds_once_per_key():
    memo, binds = KernelMemo(), []

    def bind(value):
        binds.append(value)
        return value

    assert memo.get(("a", 1), lambda: bind("first")) == "first"
    assert memo.get(("a", 1), lambda: bind("again")) == "first"
    assert memo.get(("a", 2), lambda: bind(None)) is None  # "not taken" is kept too
    assert memo.get(("a", 2), lambda: bind("again")) is None
    assert binds == ["first", None]
    for copied in (copy.deepcopy(memo), pickle.loads(pickle.dumps(memo))):  # a copy binds its own tensors
        assert copied.get(("a", 2), lambda: "own") == "own"


def _decode(model, ids):
    return hc.generate(model, ids, max_new_tokens=4).logits


def _fresh(monkeypatch, model, ids):
    """The logits with every call bound afresh (what the memo must always give)."""
    with monkeypatch.context() as m:
        m.setattr(KernelMemo, "get", lambda self, key, bind: bind())
        return _decode(model, ids)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=t.is_floating_point())  # packed int8 weights take no gradient


def _layers(model):
    return [m for m in model.modules() if type(m).__name__ == "Gemma3DecoderLayer"]


@pytest.mark.parametrize("weights", [None, "int8"])
def test_bound_calls_follow_every_change_of_the_weights(checkpoints, monkeypatch, weights):
    model = hc.from_pretrained(checkpoints("gemma3"), weights=weights)
    ids = prompts(1, 6, seed=3)
    layer = _layers(model)[0]
    attn = layer.self_attn
    changes = {
        # in place: a norm's effective scale (1 + weight) is derived from the values
        "norm in place": lambda: layer.post_feedforward_layernorm.weight.add_(0.25),
        "q norm in place": lambda: attn.q_norm.weight.add_(0.5),
        "input norm in place": lambda: layer.input_layernorm.weight.add_(0.5),
        # replaced parameters and buffers
        "o_proj replaced": lambda: setattr(attn.o_proj, "weight", _param(attn.o_proj.weight.flip(0))),
        "k norm replaced": lambda: setattr(attn.k_norm, "weight", _param(attn.k_norm.weight + 1)),
        "down_proj replaced": lambda: setattr(
            layer.mlp.down_proj, "weight", _param(layer.mlp.down_proj.weight.flip(1))
        ),
        "q_proj replaced (the group unfuses)": lambda: setattr(
            attn.q_proj, "weight", _param(attn.q_proj.weight.flip(0))
        ),
        # a .data swap keeps the parameter object
        "post norm .data": lambda: setattr(
            layer.post_attention_layernorm.weight, "data", layer.post_attention_layernorm.weight.data + 0.75
        ),
    }
    before = _decode(model, ids)
    for name, change in changes.items():
        with torch.no_grad():
            change()
        got, want = _decode(model, ids), _fresh(monkeypatch, model, ids)
        assert torch.equal(got, want), name
        assert not torch.equal(got, before), f"{name}: the change did not change the output (a vacuous check)"
        before = got


def test_bound_calls_follow_a_round_trip_through_another_dtype(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(2, 5, seed=4)
    want = _decode(model, ids)
    model.to(torch.float64)  # the torch path (the kernels take float32 only); every parameter gets new storage
    hc.generate(model, ids, max_new_tokens=2)
    model.to(torch.float32)
    assert torch.equal(_decode(model, ids), _fresh(monkeypatch, model, ids))
    torch.testing.assert_close(_decode(model, ids), want, rtol=0, atol=1e-5)  # unfused now: rounding-level change


def test_a_copied_model_binds_its_own_weights(checkpoints):
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(1, 6, seed=5)
    want = _decode(model, ids)  # binds the original's layers
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in _layers(twin):
            layer.mlp.down_proj.weight.mul_(2.0)
            layer.post_feedforward_layernorm.weight.add_(1.0)
    changed = _decode(twin, ids)
    assert not torch.equal(changed, want)
    assert torch.equal(_decode(model, ids), want)  # the original still reads its own weights

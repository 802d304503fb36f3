"""The fast path's one install point (hybridcache/accel/install.py): from_pretrained attaches it, `uninstall` gives
the reference modules back, and the two give the same tokens and bit-identical logits (the fast path runs the same
kernels in the same order). Capability flags, not identity checks, keep it off what it does not compute."""

import pytest
import torch

import hybridcache as hc
from hybridcache import accel
from hybridcache.accel import kernel_status
from hybridcache.accel.layers.sandwich import SandwichAccel
from hybridcache.accel.mixers import attention as attention_mixer
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.runs import decode_run
from hybridcache.nn.attention.mixer import AttentionMixer
from tests.models.conftest import prompts, without_recurrent_steps

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def _counting(monkeypatch, cls, name, calls: list | None = None) -> list:
    """Count calls of cls.name into `calls` (a new list unless given)."""
    calls = [] if calls is None else calls
    real = getattr(cls, name)

    def counted(*a, **k):
        calls.append(name)
        return real(*a, **k)

    monkeypatch.setattr(cls, name, counted)
    return calls


def test_from_pretrained_installs_the_fast_path(checkpoints):
    model = hc.from_pretrained(checkpoints("gemma3"))
    assert isinstance(model.fast_path, accel.FastPath)
    mixers = [m for m in model.modules() if isinstance(m, AttentionMixer)]
    assert mixers and all(type(m.accel) is AttentionAccel and m.accel.mixer is m for m in mixers)
    assert all(type(layer.accel) is SandwichAccel for layer in model.decoder_layers)
    accel.uninstall(model)
    assert model.fast_path is None and all(m.accel is None for m in mixers + list(model.decoder_layers))


@pytest.mark.parametrize("family, route", [("gemma3", "greedy"), ("jamba", "record")])  # jamba: a layer program
def test_uninstalled_is_the_same_decode(checkpoints, monkeypatch, family, route):
    model = hc.from_pretrained(checkpoints(family))
    without_recurrent_steps(model)
    ids = prompts(1, 7, seed=3)
    calls = _counting(monkeypatch, decode_run.DecodeRun, "greedy")
    _counting(monkeypatch, AttentionAccel, "one_call_step", calls)
    _counting(monkeypatch, AttentionAccel, "record", calls)
    fast = hc.generate(model, ids, max_new_tokens=12)
    assert route in calls  # the fast path ran
    calls.clear()
    accel.uninstall(model)
    ref = hc.generate(model, ids, max_new_tokens=12)
    assert calls == []  # ... and now nothing of it
    assert torch.equal(fast.sequences, ref.sequences) and torch.equal(fast.logits, ref.logits)
    accel.install(model)
    without_recurrent_steps(model)
    again = hc.generate(model, ids, max_new_tokens=12)
    assert calls and torch.equal(again.logits, fast.logits)


@pytest.mark.parametrize("family, plain", [("olmo_hybrid", False), ("jamba", True)])
def test_a_mixer_that_projects_its_own_way_is_left_alone(checkpoints, monkeypatch, family, plain):
    model = hc.from_pretrained(checkpoints(family))
    mixers = [m for m in model.modules() if isinstance(m, AttentionMixer)]
    assert mixers and all(m.plain_projection is plain for m in mixers)

    def refuse(*a):
        raise AssertionError("bound a fused q / k / v kernel")

    monkeypatch.setattr(attention_mixer, "bind_attention_step", refuse)
    monkeypatch.setattr(attention_mixer, "bind_qkv_norm_rope", refuse)
    run = lambda: hc.generate(model, prompts(1, 5, seed=1), max_new_tokens=3)  # noqa: E731
    if plain:  # the control: a plain mixer does bind them
        with pytest.raises(AssertionError, match="bound a fused"):
            run()
    else:
        run()


def test_a_model_whose_embed_or_head_is_its_own_gets_no_greedy_loop(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(1, 6, seed=2)
    calls = _counting(monkeypatch, decode_run.DecodeRun, "greedy")
    want = hc.generate(model, ids, max_new_tokens=8)
    assert calls  # the control: the plain model takes the loop
    calls.clear()
    monkeypatch.setattr(type(model), "plain_embed_head", False)
    got = hc.generate(model, ids, max_new_tokens=8)
    assert calls == [] and torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)

"""A decode step's attention in one kernel call (accel/native/steps/attention.py through accel/mixers/attention.py's
AttentionAccel.one_call_step): the token's keys and values written by the kernel straight into the slot the cache
layer reserved (AttentionCacheLayer.decode_slot). It runs the same kernels in the same order as the separate calls
(q/k/v kernel, the cache's append, the attention kernel), so logits, tokens and the cache itself must be
bit-identical to them, past the sliding window, with left padding, and after a block that failed."""

from contextlib import contextmanager

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.layers import sandwich as sandwich_layer
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.runs import layer_records
from hybridcache.nn.attention.mixer import AttentionMixer
from tests.models.conftest import failed_step_changes_nothing, generate_with_cache, left_padded, prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def _separate(monkeypatch):
    """Every decode step by the separate calls."""
    _per_layer(monkeypatch)
    monkeypatch.setattr(AttentionAccel, "one_call_step", lambda self, *a: (None, None))


def _per_layer(monkeypatch):
    """Every decode step layer by layer (not the many-layer call of accel/runs/layer_records.py, tested apart)."""
    monkeypatch.setattr(layer_records, "record_step", lambda *a: None)


def _counted(monkeypatch) -> list:
    """Which calls the one-call step served (True) or left to the separate path (False), layer by layer."""
    _per_layer(monkeypatch)
    seen, real = [], AttentionAccel.one_call_step

    def counted(self, *a):
        out = real(self, *a)
        seen.append(out[0] is not None)
        return out

    monkeypatch.setattr(AttentionAccel, "one_call_step", counted)
    return seen


@pytest.mark.parametrize("weights", [None, "bfloat16", "int8"])
def test_one_call_step_is_the_separate_calls(checkpoints, monkeypatch, weights):
    model = hc.from_pretrained(checkpoints("gemma3"), weights=weights)
    ids, mask = left_padded(2, 7, seed=5)
    tails = []
    with monkeypatch.context() as m:
        served = _counted(m)
        real_tail = sandwich_layer.decoder_tail
        m.setattr(sandwich_layer, "decoder_tail", lambda h, *a: tails.append(h.shape[1]) or real_tail(h, *a))
        seqs, logits, cache = generate_with_cache(model, ids, mask, 12)  # 7 + 12 tokens: past the sliding window of 8
    layers = len(model.decoder_layers)
    assert served == [True] * (11 * layers)  # every layer of every decode step, in one call
    assert 1 not in tails  # ... the decoder tail included (the prompt's block runs it apart)
    with monkeypatch.context() as m:
        _separate(m)
        want_seqs, want_logits, want_cache = generate_with_cache(model, ids, mask, 12)
    assert torch.equal(seqs, want_seqs)
    assert torch.equal(logits, want_logits)
    for got, want in zip(cache, want_cache, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_failed_block_leaves_the_cache_as_it_was(checkpoints, monkeypatch):
    """The kernel wrote a reserved slot of the first layers, then a later layer failed: the block is aborted and
    the next step runs as if the failed one never happened."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    last = model.decoder_layers[-1]

    @contextmanager
    def failing():
        with monkeypatch.context() as m, pytest.raises(RuntimeError, match="layer failed"):
            _per_layer(m)
            m.setattr(type(last), "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("layer failed")))
            yield

    failed_step_changes_nothing(model, prompts(1, 5, seed=2), failing)


def test_a_reserved_slot_the_kernel_declines_is_written_by_the_separate_path(checkpoints, monkeypatch):
    """If the bound call declines after the slot was reserved, the separate path computes k and v and writes them
    there: the same numbers as never reserving."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(1, 6, seed=4)
    want = hc.generate(model, ids, max_new_tokens=5).logits
    real_bind = AttentionAccel._bind_step

    def declining(self, *a):  # a bound call (alone, or inside the whole-layer call) that declines every step
        run = real_bind(self, *a)
        if run is None:
            return None
        decline = lambda *args: None  # noqa: E731
        decline.prepare, decline.dims = decline, run.dims
        return decline

    with monkeypatch.context() as m:
        m.setattr(AttentionAccel, "_bind_step", declining)
        for mixer in model.modules():
            if isinstance(mixer, AttentionMixer):
                mixer.accel.step_memo.entry = (object(), None)  # bind again, declining
        served = _counted(m)
        got = hc.generate(model, ids, max_new_tokens=5).logits
    assert served and not any(served)
    assert torch.equal(got, want)


class _Abort(Exception):
    pass


@pytest.mark.parametrize(
    "cache_config, reserved",
    [
        ({"attention": {"storage": "int8"}}, set()),  # quantized storage: update() quantizes
        ({"full": {"type": "h2o", "budget": 8}}, {"sliding"}),  # H2O reads attention weights; sliding stays dense
        ("static", set()),  # preallocated slots
        (None, {"sliding", "full"}),  # the native dense layers
    ],
)
def test_only_dense_appending_layers_reserve_a_slot(checkpoints, cache_config, reserved):
    model = hc.from_pretrained(checkpoints("gemma3"))
    static = cache_config == "static"
    cache = model.make_cache(1, None if static else cache_config, 16 if static else None)
    hc.generate(model, prompts(1, 4, seed=1), max_new_tokens=1, cache=cache)
    got = set()
    with pytest.raises(_Abort), cache.block(None, 1):
        for entry in cache.entries:
            if entry.decode_slot() is not None:
                got.add(type(entry).type_name)
            else:
                assert not entry.fed  # nothing staged
        raise _Abort  # (the reserved slots were never written: the block is dropped)
    assert got == reserved

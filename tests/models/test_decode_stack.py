"""An eager decode step's decoder layers in one C call (accel/runs/layer_records.py, accel/native/decoder_stack.py,
kernels/cpu_decode.c hc_decoder_stack). The call runs each layer's hc_decoder_layer with the arguments the per-layer
call would pass, in the same order, so logits, tokens and the cache must be bit-identical to the per-layer calls
and to the separate ones; hooks, declining kernels and failures split or abort the run without changing that."""

import copy
import ctypes
from contextlib import contextmanager

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.layers.sandwich import SandwichAccel
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.native import decoder_stack as cpu_decoder_stack
from hybridcache.accel.runs import layer_records
from tests.models.conftest import failed_step_changes_nothing, generate_with_cache, left_padded, prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def _calls(monkeypatch) -> list[int]:
    """How many layers each many-layer call ran."""
    sizes, real = [], cpu_decoder_stack.call_records

    def counted(records):
        sizes.append(len(records))
        return real(records)

    monkeypatch.setattr(layer_records, "call_records", counted)
    return sizes


def _same(got, want):
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


@pytest.mark.parametrize("weights", [None, "bfloat16", "int8"])
def test_the_stack_is_the_per_layer_and_the_separate_calls(checkpoints, monkeypatch, weights):
    model = hc.from_pretrained(checkpoints("gemma3"), weights=weights)
    ids, mask = left_padded(2, 7, seed=5)
    with monkeypatch.context() as m:
        sizes = _calls(m)
        got = generate_with_cache(model, ids, mask, 12)  # 7 + 12 tokens: past the sliding window of 8
    assert sizes == [len(model.decoder_layers)] * 11  # every decode step: all layers in one call
    with monkeypatch.context() as m:
        m.setattr(layer_records, "record_step", lambda *a: None)
        per_layer = generate_with_cache(model, ids, mask, 12)
        m.setattr(AttentionAccel, "_reserve_with", lambda self, *a: None)
        separate = generate_with_cache(model, ids, mask, 12)
    _same(got, per_layer)
    _same(got, separate)


def test_a_hooked_layer_splits_the_run_and_its_hook_runs(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids, n = prompts(1, 6, seed=3), len(model.decoder_layers)
    want = generate_with_cache(model, ids, None, 6)
    seen = []
    handle = model.decoder_layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    try:
        with monkeypatch.context() as m:
            sizes = _calls(m)
            got = generate_with_cache(model, ids, None, 6)
    finally:
        handle.remove()
    assert len(seen) == 6  # the prompt's block and the 5 decode steps: the hook saw every call of its layer
    assert sizes == [1, n - 2] * 5  # layer 0, then (layer 1 as a module call) layers 2..n-1
    _same(got, want)


def test_a_layer_whose_kernel_declines_after_reserving_runs_apart(checkpoints, monkeypatch):
    """The slot is reserved, then the record declines: the run so far goes first, then the layer's separate path
    writes the slot, then the rest in one call. The same numbers."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids, n = prompts(2, 6, seed=4), len(model.decoder_layers)
    want = generate_with_cache(model, ids, None, 5)
    declining = model.decoder_layers[2].self_attn
    real = AttentionAccel._reserve_with

    def reserve(self, *a):
        got = real(self, *a)
        if got is None or self.mixer is not declining:
            return got
        run, args, reserved = got

        class Declines:  # the bound call, whose record declines (its own call is never reached here)
            record = staticmethod(lambda *a: None)

        return Declines, args, reserved

    with monkeypatch.context() as m:
        m.setattr(AttentionAccel, "_reserve_with", reserve)
        sizes = _calls(m)
        got = generate_with_cache(model, ids, None, 5)
    assert sizes == [2, n - 3] * 4
    _same(got, want)


def test_a_failed_call_leaves_the_cache_as_it_was(checkpoints, monkeypatch):
    """The C call ran some layers (their slots written), then failed: the block is aborted, the cache holds what
    it held, and the next steps equal a fresh run."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    real = cpu_decoder_stack.call_records

    def fails(records):
        real(records[:3])  # the first layers ran and wrote their reserved slots
        raise MemoryError("hc_decoder_stack: layer 3 found no memory for its attention's scratch")

    @contextmanager
    def failing():
        with monkeypatch.context() as m, pytest.raises(MemoryError, match="layer 3"):
            m.setattr(layer_records, "call_records", fails)
            yield

    failed_step_changes_nothing(model, prompts(1, 5, seed=2), failing)


def test_layers_without_records_run_as_module_calls(checkpoints, monkeypatch):
    """A cache type whose layers do not reserve slots (int8 storage): no many-layer call, every layer its usual
    call, the same numbers as the loop."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids, config = prompts(2, 5, seed=1), {"attention": {"storage": "int8"}}
    with monkeypatch.context() as m:
        sizes = _calls(m)
        got = hc.generate(model, ids, max_new_tokens=4, cache_config=config)
    assert sizes == []
    with monkeypatch.context() as m:
        m.setattr(layer_records, "record_step", lambda *a: None)
        want = hc.generate(model, ids, max_new_tokens=4, cache_config=config)
    assert torch.equal(got.logits, want.logits)


def test_a_library_whose_record_is_not_the_declared_one_is_not_called(checkpoints, monkeypatch):
    """The library states its record's field types; other than the declared ones, the per-layer calls run."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(1, 5, seed=6)
    want = hc.generate(model, ids, max_new_tokens=4)
    assert cpu_decoder_stack.record_type() is not None
    with monkeypatch.context() as m:
        m.setattr(cpu_decoder_stack, "LAYER_RECORD", cpu_decoder_stack.LAYER_RECORD[:-1] + [ctypes.c_float])
        m.setattr(cpu_decoder_stack, "_state", {})
        assert cpu_decoder_stack.record_type() is None
        sizes = _calls(m)
        got = hc.generate(model, ids, max_new_tokens=4)
    assert sizes == []
    assert torch.equal(got.logits, want.logits)


def test_an_early_exit_draft_runs_its_layers_in_one_call(checkpoints, monkeypatch):
    """The self-speculative draft (the target's first layers) decodes through the same call: its logits equal its
    per-layer calls."""
    from hybridcache.generation.sources.speculative import EarlyExitDraft

    model = hc.from_pretrained(checkpoints("gemma3"))
    draft = EarlyExitDraft(model, 3)
    ids = prompts(2, 6, seed=8)
    with monkeypatch.context() as m:
        sizes = _calls(m)
        got = hc.generate(draft, ids, max_new_tokens=5)
    assert sizes == [3] * 4
    with monkeypatch.context() as m:
        m.setattr(layer_records, "record_step", lambda *a: None)
        want = hc.generate(draft, ids, max_new_tokens=5)
    assert torch.equal(got.logits, want.logits)


def _bindings(monkeypatch) -> list[int]:
    """The layer of each decode_binding call."""

    made, real = [], SandwichAccel.binding

    def counted(self, x, layer):
        made.append(self)
        return real(self, x, layer)

    monkeypatch.setattr(SandwichAccel, "binding", counted)
    return made


def test_a_generation_without_callbacks_binds_each_layer_once(checkpoints, monkeypatch):
    """No code of the user's runs between the steps: each layer is bound at the first decode step and kept, with
    the same numbers as binding it every step (a streamer: the user's code runs between the steps)."""
    model = hc.from_pretrained(checkpoints("gemma3"), weights="int8")
    ids, mask = left_padded(2, 7, seed=9)
    n = len(model.decoder_layers)
    with monkeypatch.context() as m:
        made = _bindings(m)
        got = generate_with_cache(model, ids, mask, 10)
    assert len(made) == n  # 9 decode steps, one binding per layer
    with monkeypatch.context() as m:
        made = _bindings(m)
        out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=10, streamer=lambda tokens: None)
    assert len(made) == n * 9  # every step
    cache = [(e.keys.clone(), e.values.clone(), e.key_pos.clone()) for e in out.cache.entries]
    _same(got, (out.sequences, out.logits, cache))


def _edits(model, at: int):
    """A streamer that, after `at` tokens, edits what the layers' bindings read: a norm's weight in place, a
    projection's weight by a .data swap, an MLP module replaced."""
    seen = []

    def edit(tokens):
        seen.append(tokens)
        if len(seen) == at:
            with torch.no_grad():
                model.decoder_layers[0].input_layernorm.weight.add_(0.5)
                o = model.decoder_layers[1].self_attn.o_proj
                o.weight.data = o.weight.data.flip(0).contiguous()
                mlp = model.decoder_layers[2].mlp
                mlp.down_proj = copy.deepcopy(mlp.down_proj)
                mlp.down_proj.weight.data.mul_(-1)

    return edit


@pytest.mark.parametrize("how", ["streamer", "hook"])
def test_an_edit_between_steps_is_seen_at_the_next_step(checkpoints, monkeypatch, how):
    """The user's code between the steps (a streamer, or a forward hook anywhere in the model) may change what a
    layer was bound to: then each step binds again, and the edit counts from the next step on, as in the per-layer
    calls (which check their keys every call)."""
    ids = prompts(2, 6, seed=10)

    def run(stack: bool):
        model = hc.from_pretrained(checkpoints("gemma3"))
        edit = _edits(model, 3)
        with monkeypatch.context() as m:
            if not stack:
                m.setattr(layer_records, "record_step", lambda *a: None)
            if how == "streamer":
                return hc.generate(model, ids, max_new_tokens=8, streamer=edit)
            handle = model.model.embed_tokens.register_forward_hook(lambda mod, a, out: edit(None))
            try:
                return hc.generate(model, ids, max_new_tokens=8)
            finally:
                handle.remove()

    got, want = run(True), run(False)
    assert torch.equal(got.logits, want.logits)
    unedited = hc.generate(hc.from_pretrained(checkpoints("gemma3")), ids, max_new_tokens=8)
    assert not torch.equal(got.logits[:, 3:], unedited.logits[:, 3:])  # the edit did change the numbers


def test_an_edit_between_two_generations_is_seen(checkpoints):
    """Kept bindings last one generate call: an edit before the next (continuing the same cache) is seen."""
    ids = prompts(1, 6, seed=11)
    results = []
    for stack in (True, False):
        model = hc.from_pretrained(checkpoints("gemma3"), weights="bfloat16")
        first = hc.generate(model, ids, max_new_tokens=4)
        with torch.no_grad():
            model.decoder_layers[1].post_feedforward_layernorm.weight.mul_(3.0)
        with pytest.MonkeyPatch.context() as m:
            if not stack:
                m.setattr(layer_records, "record_step", lambda *a: None)
            results.append(hc.generate(model, first.sequences, max_new_tokens=4, cache=first.cache))
    assert torch.equal(results[0].logits, results[1].logits)


def test_beam_search_binds_each_layer_once(checkpoints, monkeypatch):
    """Beam search's loop has no code of the user's between steps either (no processor or criterion given): one
    binding per layer, the same sequences and scores as the per-layer calls."""
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(2, 6, seed=12)
    with monkeypatch.context() as m:
        made = _bindings(m)
        got = hc.beam_search(model, ids, num_beams=3, max_new_tokens=6)
    assert len(made) == len(model.decoder_layers)
    with monkeypatch.context() as m:
        m.setattr(layer_records, "record_step", lambda *a: None)
        want = hc.beam_search(model, ids, num_beams=3, max_new_tokens=6)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.sequences_scores, want.sequences_scores)

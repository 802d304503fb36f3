"""Decode runs of pre-norm models (accel/program_run.py): attention and recurrent layers mixed, the cache fed once
per run of steps.

The oracle is the step-by-step decode (the same model with runs turned off): the same sequences and logits bit for
bit, and the same cache after (every layer's held tensors: keys, values, key positions, states, checkpoint trails;
the counts, the token fingerprint and its history), over several runs and in a continuation. A lossy state codec
or offloaded states decline (step by step, still exact); rollback runs and keeps the same trail. A failure
mid-run leaves the cache as it was when the run began, and free."""

import copy

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import FastPath, decode_run, kernel_status, layer_records, program_run
from tests.cache.helpers import state_equal
from tests.models.conftest import prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

FAMILIES = ["mamba2", "lfm2", "bamba", "mamba"]  # (jamba: its MoE layers do not record; declined below)


@pytest.fixture(scope="module")
def family(checkpoints):
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = hc.from_pretrained(checkpoints(name))
        return loaded[name]

    return get


def _generate(model, ids, monkeypatch, runs: bool, **kw):
    """generate, and the capacity of each run started."""
    started, real = [], decode_run.DecodeRun.start.__func__

    def start(cls, *args):
        run = real(cls, *args)
        if run is not None:
            started.append(args[2])
        return run

    with monkeypatch.context() as m:
        m.setattr(decode_run.DecodeRun, "start", classmethod(start))
        out = hc.generate(model, ids, decode_runs=runs, **kw)  # (False: every step through model.feed_block)
    return out, started


def _same_cache(got, want) -> None:
    assert state_equal(got.snapshot(), want.snapshot())
    assert torch.equal(got.seq.fingerprint, want.seq.fingerprint)
    assert torch.equal(got.seq.history(), want.seq.history())


def _same(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)
    _same_cache(got.cache, want.cache)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("run_tokens, runs", [(128, [19]), (5, [5, 5, 5, 4])])
def test_a_run_is_the_step_by_step_decode(family, monkeypatch, name, run_tokens, runs):
    model, ids = family(name), prompts(1, 7, seed=5)
    monkeypatch.setattr(FastPath, "run_tokens", run_tokens)
    got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=20)
    want, none = _generate(model, ids, monkeypatch, False, max_new_tokens=20)
    assert started == runs and none == []  # 19 tokens fed after the prompt
    _same(got, want)
    # a continuation of each cache, by a run and step by step: the same again
    more, started = _generate(model, got.sequences, monkeypatch, True, max_new_tokens=6, cache=got.cache)
    again, _ = _generate(model, want.sequences, monkeypatch, False, max_new_tokens=6, cache=want.cache)
    assert started == [5]  # the continuation's first block step by step, then a run of 5 steps
    _same(more, again)


@pytest.mark.parametrize("name", ["bamba", "lfm2"])
@pytest.mark.parametrize(
    "config, runs",
    [
        ({"recurrent": {"rollback": 3}}, True),  # the trail kept as one-token blocks keep it
        ({"recurrent": {"rollback": 1}}, True),
        ({"recurrent": {"state_codec": "int8", "quantize_conv": True}}, False),  # re-encoded per block: declined
        ({"recurrent": {"state_codec": "bfloat16", "quantize_conv": True}}, False),
        ({"recurrent": {"offload": True}}, False),
    ],
)
def test_recurrent_storage_runs_or_declines_exactly(family, monkeypatch, name, config, runs):
    model, ids = family(name), prompts(1, 6, seed=3)
    got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=9, cache_config=config)
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=9, cache_config=config)
    assert started == ([8] if runs else [])
    _same(got, want)
    if config["recurrent"].get("rollback"):  # and rewinds as far
        k = config["recurrent"]["rollback"]
        got.cache.crop(got.cache.columns - k)
        want.cache.crop(want.cache.columns - k)
        _same_cache(got.cache, want.cache)


def test_moe_layers_decline(family, monkeypatch):
    model, ids = family("jamba"), prompts(1, 6, seed=4)
    got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=6)
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=6)
    assert started == []
    _same(got, want)


class _FailingLibrary:
    """The library, with hc_layer_program failing at its third call."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def hc_layer_program(self, *args):
        self.calls += 1
        return -1 if self.calls == 3 else self.lib.hc_layer_program(*args)


@pytest.mark.parametrize("name", ["bamba", "mamba2"])
def test_a_failed_run_leaves_the_cache_as_it_began_and_free(family, monkeypatch, name):
    model, ids = family(name), prompts(1, 6, seed=9)
    out = hc.generate(model, ids, max_new_tokens=3)
    began = copy.deepcopy(out.cache)
    hc.generate(model, out.sequences, max_new_tokens=1, cache=began)  # the continuation's first block, step by step
    with monkeypatch.context() as m:
        lib = _FailingLibrary(program_run._library())
        m.setattr(program_run, "_library", lambda: lib)
        with pytest.raises(MemoryError, match="hc_layer_program"):
            hc.generate(model, out.sequences, max_new_tokens=8, cache=out.cache)
    assert lib.calls == 3
    _same_cache(out.cache, began)  # the steps that ran were never fed
    fresh = hc.generate(model, ids, max_new_tokens=7)
    held = out.cache.columns
    more = fresh.sequences[:, : held + 1]  # one token it has not seen
    again, started = _generate(model, more, monkeypatch, True, max_new_tokens=3, cache=out.cache)
    assert started == [2] and torch.equal(again.sequences, fresh.sequences[:, : held + 4])


def test_a_run_refuses_what_does_not_fit(family):
    """Named errors before any C call, and the cache as it was once the run is abandoned."""
    model, ids = family("bamba"), prompts(1, 6, seed=17)
    cache = hc.generate(model, ids, max_new_tokens=2).cache
    before, first = cache.snapshot(), torch.tensor([[5]])
    with torch.no_grad():
        assert decode_run.DecodeRun.start(model, cache, 4, first, model.embed(first)) is None  # not steady
        with layer_records.steady():
            for capacity in (0, -3):
                assert decode_run.DecodeRun.start(model, cache, capacity, first, model.embed(first)) is None
            run = decode_run.DecodeRun.start(model, cache, 4, first, model.embed(first))
            assert isinstance(run, program_run.ProgramRun)
            h = model.embed(first)
            for bad_ids, bad_h in ((torch.tensor([[5, 6]]), h), (first, h[..., :-1]), (first, h.double())):
                with pytest.raises(ValueError, match="ProgramRun.step"):
                    run.step(bad_ids, bad_h)
            run.step(first, h)  # one step run, never fed
            run.abandon()
            with pytest.raises(RuntimeError, match="over"):
                run.step(first, h)
    assert state_equal(cache.snapshot(), before)
    cache.restore(before)  # free

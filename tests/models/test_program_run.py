"""Decode runs of pre-norm models (accel/runs/program_run.py): attention and recurrent layers mixed, the cache fed once
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
from hybridcache.accel import FastPath, kernel_status
from hybridcache.accel.runs import decode_run, layer_records, program_run
from tests.cache.helpers import state_equal
from tests.models.conftest import prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

# (jamba: MoE layers do not record; qwen3_5: gated attention, hc_gated_decoder_layer records)
FAMILIES = ["mamba2", "lfm2", "bamba", "mamba", "recurrentgemma", "nemotron_h", "qwen3_5", "lfm3"]
NO_C_LOOP = {"recurrentgemma"}  # (its soft-capped head: greedy runs step by step, ProgramRun.step)


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
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("run_tokens, runs", [(128, [19]), (5, [5, 5, 5, 4])])
def test_a_run_is_the_step_by_step_decode(family, monkeypatch, name, sampled, run_tokens, runs):
    """Greedy: many steps per C call (hc_program_steps); sampled: one C call per step (ProgramRun.step)."""
    model, ids = family(name), prompts(1, 7, seed=5)
    draw = {"do_sample": True, "seed": 3} if sampled else {}
    monkeypatch.setattr(FastPath, "run_tokens", run_tokens)
    got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=20, **draw)
    want, none = _generate(model, ids, monkeypatch, False, max_new_tokens=20, **draw)
    assert started == runs and none == []  # 19 tokens fed after the prompt
    _same(got, want)
    # a continuation of each cache, by a run and step by step: the same again
    more, started = _generate(model, got.sequences, monkeypatch, True, max_new_tokens=6, cache=got.cache, **draw)
    again, _ = _generate(model, want.sequences, monkeypatch, False, max_new_tokens=6, cache=want.cache, **draw)
    # greedy: the uncached token and 5 more, in runs of 5 at most; sampled: the uncached token's block, then 5
    stepped = sampled or name in NO_C_LOOP  # (the C loop takes the uncached token; a step by step run does not)
    assert started == ([5] if stepped else [6] if run_tokens > 6 else [5, 1])
    _same(more, again)


@pytest.mark.parametrize("name", ["bamba", "mamba"])
@pytest.mark.parametrize("sampled", [False, True])
def test_stopped_by_eos(family, monkeypatch, name, sampled):
    model, ids = family(name), prompts(1, 6, seed=7)
    draw = {"do_sample": True, "seed": 3} if sampled else {}
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=12, **draw)
    eos = int(want.sequences[0, 6 + 5])  # the 6th token: the generation stops there
    first = int((want.sequences[0, 6:] == eos).nonzero()[0])
    kw = {"max_new_tokens": 12, "eos_token_id": [eos, 1], **draw}
    got, started = _generate(model, ids, monkeypatch, True, **kw)
    stopped, _ = _generate(model, ids, monkeypatch, False, **kw)
    assert started == [11] and first <= 5
    _same(got, stopped)
    assert got.logits.shape[1] == first + 1


def test_one_run_stepped_then_greedy(family, monkeypatch):
    """A run's steps by `step` (one C call each) then by `greedy` (many per call) continue one another."""
    model, ids = family("bamba"), prompts(1, 6, seed=13)
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=12)
    out = hc.generate(model, ids, max_new_tokens=1)
    cache, tokens, logits = out.cache, [int(out.sequences[0, -1])], [out.logits[:, 0]]
    with torch.no_grad(), layer_records.steady():
        first = torch.tensor([[tokens[0]]])
        run = decode_run.DecodeRun.start(model, cache, 11, first, model.embed(first))
        assert isinstance(run, program_run.ProgramRun)
        for _ in range(3):
            t = torch.tensor([[tokens[-1]]])
            logits.append(model.head(run.step(t, model.embed(t)))[:, -1])
            tokens.append(int(logits[-1].argmax()))
        more, rows = run.greedy(model, tokens[-1], 8, [], True)
        run.finish()
    assert run.steps == 11 and more.shape == (8,)
    assert torch.equal(torch.tensor(tokens[1:] + more.tolist()), want.sequences[0, 7:])
    assert torch.equal(torch.cat([*logits, rows]), want.logits[0])
    _same_cache(cache, want.cache)


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
    """The library, with hc_layer_program failing at its third call, hc_program_steps after 2 steps."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def hc_layer_program(self, *args):
        self.calls += 1
        return -1 if self.calls == 3 else self.lib.hc_layer_program(*args)

    def hc_program_steps(self, *args):
        args = list(args)
        args[18] = min(2, args[18])  # steps
        self.calls += 1
        self.lib.hc_program_steps(*args)
        return -1


# (recurrentgemma: no C loop, so its run's steps are ProgramRun.step's, the sampled case)
@pytest.mark.parametrize(
    "name, sampled",
    [
        ("bamba", False),
        ("bamba", True),
        ("mamba2", False),
        ("mamba2", True),
        ("recurrentgemma", True),
        ("nemotron_h", False),
        ("nemotron_h", True),
    ],
)
def test_a_failed_run_leaves_the_cache_as_it_began_and_free(family, monkeypatch, name, sampled):
    """Greedy: the C loop fails after 2 steps; sampled: the third step's program call fails."""
    model, ids = family(name), prompts(1, 6, seed=9)
    kw = {"do_sample": True, "seed": 1} if sampled else {}
    out = hc.generate(model, ids, max_new_tokens=3, **kw)
    began = copy.deepcopy(out.cache)
    if sampled:  # its run begins after the continuation's first block (the uncached token); greedy's feeds it
        hc.generate(model, out.sequences, max_new_tokens=1, cache=began, **kw)
    with monkeypatch.context() as m:
        lib = _FailingLibrary(program_run._library())
        m.setattr(program_run, "_library", lambda: lib)
        with pytest.raises(MemoryError, match="hc_layer_program" if sampled else "hc_program_steps"):
            hc.generate(model, out.sequences, max_new_tokens=8, cache=out.cache, **kw)
    assert lib.calls == (3 if sampled else 1)
    _same_cache(out.cache, began)  # the steps that ran were never fed
    fresh = hc.generate(model, ids, max_new_tokens=7, **kw)
    held = out.cache.columns
    more = fresh.sequences[:, : held + 1]  # one token it has not seen
    again, started = _generate(model, more, monkeypatch, True, max_new_tokens=3, cache=out.cache, **kw)
    assert started == [2 if sampled else 3] and torch.equal(again.sequences[:, : held + 1], more)
    if not sampled:  # (sampling draws from the seed anew: the same tokens only from the same start)
        assert torch.equal(again.sequences, fresh.sequences[:, : held + 4])


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
            for bad in ((-1, 2, []), (model.vocab_size, 2, []), (5, 0, []), (5, 5, []), (5, 2, [-1]), (5, 2.0, [])):
                with pytest.raises(ValueError, match="do not fit"):
                    run.greedy(model, *bad, False)
            for bad_ids, bad_h in ((torch.tensor([[5, 6]]), h), (first, h[..., :-1]), (first, h.double())):
                with pytest.raises(ValueError, match="ProgramRun.step"):
                    run.step(bad_ids, bad_h)
            run.step(first, h)  # one step run, never fed
            run.abandon()
            with pytest.raises(RuntimeError, match="over"):
                run.step(first, h)
            with pytest.raises(RuntimeError, match="over"):
                run.greedy(model, 5, 1, [], False)
    assert state_equal(cache.snapshot(), before)
    cache.restore(before)  # free


def test_runs_only_where_nothing_else_runs_between_steps(family, monkeypatch):
    """Two rows, a streamer, a logits processor, a hook, beam search: step by step (the same tokens as with runs
    turned off)."""
    model = family("bamba")
    one, two = prompts(1, 6, seed=2), prompts(2, 6, seed=2)
    cases = [
        (two, {}),
        (one, {"streamer": lambda tokens: None}),
        (one, {"logits_processor": [lambda ids, scores: scores]}),
    ]
    for ids, kw in cases:
        got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=5, **kw)
        want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=5, **kw)
        assert started == [] and torch.equal(got.sequences, want.sequences), kw
    handle = model.decoder_layers[1].register_forward_pre_hook(lambda mod, args: None)
    try:
        _, started = _generate(model, one, monkeypatch, True, max_new_tokens=5)
    finally:
        handle.remove()
    assert started == []
    started, real = [], decode_run.DecodeRun.start.__func__
    with monkeypatch.context() as m:
        m.setattr(decode_run.DecodeRun, "start", classmethod(lambda cls, *a: started.append(1) or real(cls, *a)))
        hc.beam_search(model, one, num_beams=2, max_new_tokens=4)
    assert started == []


def test_a_non_finite_step_is_reported_as_step_by_step(checkpoints, monkeypatch):
    """A NaN embedding row of the first generated token: the greedy C loop reports the step after it as the
    step-by-step decode does, and the run's cache is let go unchanged."""
    model, prompt = hc.from_pretrained(checkpoints("bamba")), prompts(1, 5, seed=6)
    first = int(hc.generate(model, prompt, max_new_tokens=1).sequences[0, -1])
    with torch.no_grad():
        model.model.embed_tokens.weight[first] = float("nan")
    errors, calls, real = [], [], program_run.ProgramRun.greedy
    monkeypatch.setattr(program_run.ProgramRun, "greedy", lambda *a: calls.append(1) or real(*a))
    for runs in (True, False):
        cache = model.make_cache(1)
        model(prompt, cache)  # (the prompt fed: the continuation's first step is the run's)
        before = cache.snapshot()
        with pytest.raises(hc.models.core.base.GenerationError, match="not finite") as err:
            _generate(
                model, torch.cat([prompt, torch.tensor([[first]])], 1), monkeypatch, runs, max_new_tokens=4, cache=cache
            )
        errors.append(str(err.value))
        assert state_equal(cache.snapshot(), before) if runs else True
    assert errors[0] == errors[1] and calls == [1]  # (the C loop found it)


def _uncapped_recurrentgemma(checkpoints):
    """RecurrentGemma with its head's soft cap off and its embedding's multiplier said (what the greedy C loop
    computes): its RG-LRU records through hc_program_steps. The multiplier is the one its `embed` rounds to bf16."""
    model = hc.from_pretrained(checkpoints("recurrentgemma"))
    model.cfg.logits_soft_cap = 0.0
    scale = float(torch.tensor(model.cfg.hidden_size**0.5, dtype=torch.bfloat16))
    model.embed_head_parts = lambda: (model.model.embed_tokens, scale, model.model.final_norm, model.lm_head)
    return model


@pytest.mark.parametrize("prompt", [0, 6])
def test_rglru_positions_move_in_the_c_loop(checkpoints, monkeypatch, prompt):
    """The greedy C loop moves each RG-LRU record's positions pointer with the step: from an empty cache the run's
    first step is position 0 (where the recurrence restarts) and the later ones are not (the same as step by step;
    fails with the positions left at the first step's)."""
    model = _uncapped_recurrentgemma(checkpoints)
    assert model.fast_path.greedy_loop(model)
    calls, real = [], program_run.ProgramRun.greedy
    monkeypatch.setattr(program_run.ProgramRun, "greedy", lambda *a: calls.append(1) or real(*a))
    ids = prompts(1, prompt + 1, seed=11)
    out = {}
    for runs in (True, False):
        cache = model.make_cache(1)
        if prompt:
            model(ids[:, :prompt], cache)  # (the prompt fed: the continuation's one new token starts the run)
        out[runs], started = _generate(model, ids, monkeypatch, runs, max_new_tokens=9, cache=cache)
        assert started == ([9] if runs else [])
    assert calls == [1]
    _same(out[True], out[False])


def test_rglru_positions_move_by_step_then_greedy(checkpoints, monkeypatch):
    """From an empty cache, a run's steps by `step` (the first at position 0) then by `greedy`: each moves the RG-LRU
    records' positions (fails with `step` leaving them at the first step's)."""
    model, first = _uncapped_recurrentgemma(checkpoints), torch.tensor([[5]])
    want, _ = _generate(model, first, monkeypatch, False, max_new_tokens=8)
    cache, tokens, logits = model.make_cache(1), [5], []
    with torch.no_grad(), layer_records.steady():
        run = decode_run.DecodeRun.start(model, cache, 8, first, model.embed(first))
        assert isinstance(run, program_run.ProgramRun)
        for _ in range(4):
            t = torch.tensor([[tokens[-1]]])
            logits.append(model.head(run.step(t, model.embed(t)))[:, -1])
            tokens.append(int(logits[-1].argmax()))
        more, rows = run.greedy(model, tokens[-1], 4, [], True)
        run.finish()
    assert run.steps == 8
    assert torch.equal(torch.tensor(tokens[1:] + more.tolist()), want.sequences[0, 1:])
    assert torch.equal(torch.cat([*logits, rows]), want.logits[0])
    _same_cache(cache, want.cache)  # (both fed `first` and the first 7 tokens)


def test_an_entry_shared_by_two_stateful_layers_declines():
    """A run reserves each cache entry for one attention or recurrent layer (Nemotron-H's MLP blocks beside it touch
    no cache): two such layers on one entry, or an entry no layer reads, decline before anything is reserved."""
    e, f = object(), object()
    assert program_run._one_stateful_per_entry([("attention",), ("mlp",), ("recurrent",)], [e, e, f])
    assert not program_run._one_stateful_per_entry([("attention",), ("recurrent",)], [e, e])
    assert not program_run._one_stateful_per_entry([("mlp",), ("recurrent",)], [e, f])

    class Run:
        def __init__(self, blocks):
            self.blocks = blocks

    assert program_run._blocks([Run(["a", "b"]), "c"], [e, f]) == (["a", "b", "c"], [e, e, f])
    assert program_run._blocks([Run(["a"])], [e, f]) == (None, [])

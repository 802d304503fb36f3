"""The llama.cpp worker driven with a fake `llama_cpp` module and a fake clock (no llama.cpp here): prefill (the
prompt's evaluation and the first greedy token) and decode (the other n - 1 steps) are timed apart in every repeat after
an untimed warm-up; the requantized GGUF is written atomically, reused while its digests match and rebuilt otherwise."""

import hashlib
import json
import os
from types import SimpleNamespace

import pytest

from hybridcache.reference import llamacpp_worker as worker

PREFILL_COST, DECODE_COST = 0.25, 0.5  # fake seconds per prompt token / per decode step (exact in binary)


def next_token(last: int) -> int:
    """The fake model's greedy rule: the oracle the worker's tokens are checked against."""
    return (last * 7 + 1) % 1000


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


class FakeLlama:
    def __init__(self, lib, model_path, n_ctx, n_batch, n_threads, n_threads_batch, logits_all, verbose):
        assert os.path.exists(model_path) and not logits_all and n_batch >= 1
        lib.loaded.append(
            {"path": model_path, "n_ctx": n_ctx, "n_batch": n_batch, "threads": (n_threads, n_threads_batch)}
        )
        self.lib, self.n_ctx, self.tokens = lib, n_ctx, []
        self._ctx = SimpleNamespace(ctx=self)
        self._model = SimpleNamespace(model=("model", model_path))

    def reset(self):
        self.tokens = []

    def eval(self, tokens):
        self.lib.clock.now += PREFILL_COST * len(tokens) if len(tokens) > 1 else DECODE_COST
        self.tokens += list(tokens)
        assert len(self.tokens) <= self.n_ctx
        self.lib.evals += 1

    def close(self):
        self.lib.closed += 1


def fake_llama_cpp(clock, fail_quantize=False):
    lib = SimpleNamespace(
        __version__="0.0-fake",
        LLAMA_FTYPE_ALL_F32=0,
        LLAMA_FTYPE_MOSTLY_Q8_0=7,
        LLAMA_FTYPE_MOSTLY_BF16=32,
        clock=clock,
        loaded=[],
        quantized=[],
        evals=0,
        closed=0,
        freed=0,
    )
    lib.llama_model_quantize_default_params = lambda: SimpleNamespace(ftype=None, allow_requantize=False, nthread=0)

    def quantize(src, dst, params):
        assert params.allow_requantize
        lib.quantized.append((src.decode(), params.ftype, params.nthread))
        if fail_quantize:
            open(dst, "wb").write(b"half")  # a partial file the worker must not leave behind
            return 1
        with open(dst, "wb") as f:
            f.write(open(src, "rb").read() + f"->{params.ftype}".encode())
        return 0

    lib.llama_model_quantize = quantize
    lib.Llama = lambda **kw: FakeLlama(lib, **kw)
    lib.llama_sampler_init_greedy = lambda: "greedy"
    lib.llama_sampler_sample = lambda sampler, ctx, idx: next_token(ctx.tokens[-1])

    def free(sampler):
        lib.freed += 1

    lib.llama_sampler_free = free
    add_batch_api(lib)
    return lib


class FakeContext:
    """A context of several sequences: every sequence's tokens by position; the logits of the last batch's rows
    that asked for them (the greedy rule applied to that row's token)."""

    def __init__(self, lib, params):
        self.lib, self.params, self.seqs, self.outputs = lib, params, {}, {}


def add_batch_api(lib):
    """llama.cpp's batch API (llama_batch_init / llama_decode / llama_memory_clear ...) on fake contexts."""
    lib.contexts, lib.batches_freed, lib.contexts_freed = [], 0, 0
    lib.llama_context_default_params = lambda: SimpleNamespace(
        n_ctx=0, n_batch=0, n_ubatch=0, n_seq_max=1, n_threads=0, n_threads_batch=0
    )

    def init_from_model(model, params):
        assert model[0] == "model"
        ctx = FakeContext(lib, params)
        lib.contexts.append(ctx)
        return ctx

    lib.llama_init_from_model = init_from_model
    lib.llama_batch_init = lambda n, embd, seq_max: SimpleNamespace(
        n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n, seq_id=[[0] for _ in range(n)], logits=[0] * n
    )
    lib.llama_get_memory = lambda ctx: ctx
    lib.llama_memory_clear = lambda mem, data: mem.seqs.clear()

    def decode(ctx, batch):
        assert batch.n_tokens <= ctx.params.n_batch
        ctx.outputs = {}
        for i in range(batch.n_tokens):
            assert batch.n_seq_id[i] == 1 and batch.seq_id[i][0] < ctx.params.n_seq_max
            seq = ctx.seqs.setdefault(batch.seq_id[i][0], [])
            assert batch.pos[i] == len(seq)  # positions continue each sequence
            seq.append(batch.token[i])
            if batch.logits[i]:
                ctx.outputs[i] = next_token(batch.token[i])
        assert sum(len(v) for v in ctx.seqs.values()) <= ctx.params.n_ctx
        lib.clock.now += PREFILL_COST * batch.n_tokens if batch.n_tokens > len(ctx.seqs) else DECODE_COST
        return 0

    lib.llama_decode = decode
    single = lib.llama_sampler_sample
    lib.llama_sampler_sample = lambda sampler, ctx, idx: (
        ctx.outputs[idx] if isinstance(ctx, FakeContext) else single(sampler, ctx, idx)
    )

    def free_batch(batch):
        lib.batches_freed += 1

    def free_context(ctx):
        lib.contexts_freed += 1

    lib.llama_batch_free, lib.llama_free = free_batch, free_context


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model-q4.gguf"
    path.write_bytes(b"GGUF-source")
    return path


def request(source, tmp_path, precisions=("f32", "q8_0"), prompt=(5, 6, 7, 8), new=6, repeats=3):
    return {
        "gguf": str(source),
        "gguf_sha256": None,
        "cache_dir": str(tmp_path / "cache"),
        "precisions": list(precisions),
        "prompt": list(prompt),
        "new_tokens": new,
        "threads": 2,
        "repeats": repeats,
    }


def test_phases_are_timed_apart_with_greedy_tokens(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock)
    answer = worker.serve(lib, request(source, tmp_path), clock=clock, byref=lambda p: p)
    assert answer["version"] == "0.0-fake"
    assert [r["precision"] for r in answer["results"]] == ["f32", "q8_0"]
    expected, last = [], 8
    for _ in range(6):
        last = next_token(last)
        expected.append(last)
    for r in answer["results"]:
        assert r["prefill_samples"] == [4 * PREFILL_COST] * 3  # the 4-token prompt, no decode step inside
        assert r["decode_samples"] == [5 * DECODE_COST] * 3  # exactly the other n - 1 steps
        assert r["tokens"] == expected
    # per precision: 1 warm-up + 3 timed runs, each 1 prompt eval + 5 steps; threads and context as asked
    assert lib.evals == 2 * 4 * 6
    assert all(ld["threads"] == (2, 2) and ld["n_ctx"] >= 4 + 6 for ld in lib.loaded)
    assert lib.closed == 2 and lib.freed == 2
    assert [q[1:] for q in lib.quantized] == [(0, 2), (7, 2)]


def test_long_prefill_evaluates_the_prompt_once_in_chunks(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock)
    prompt = list(range(10, 1010))
    req = {**request(source, tmp_path, precisions=("f32",), prompt=prompt), "mode": "long_prefill", "chunk": 256}
    (r,) = worker.serve(lib, req, clock=clock, byref=lambda p: p)["results"]
    assert r["prefill_s"] == 1000 * PREFILL_COST  # the prompt alone: no warm-up, no decode step
    assert r["first_token"] == next_token(prompt[-1])
    assert r["cpu_s"] >= 0 and r["peak_rss_mib"] > 0
    assert lib.evals == 1 and lib.closed == 1 and lib.freed == 1
    (loaded,) = lib.loaded
    assert loaded["n_batch"] == 256 and loaded["n_ctx"] >= 1000 and loaded["threads"] == (2, 2)


def test_requantized_file_is_reused_only_while_its_digests_match(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock)
    req = request(source, tmp_path, precisions=("bf16",), repeats=1)
    path = worker.serve(lib, req, clock=clock, byref=lambda p: p)["results"][0]["model"]
    meta = json.load(open(path + ".json"))
    assert meta["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert meta["source_sha256"] == hashlib.sha256(b"GGUF-source").hexdigest() and meta["precision"] == "bf16"
    assert len(lib.quantized) == 1 and sorted(os.listdir(tmp_path / "cache")) == sorted(
        [os.path.basename(path), os.path.basename(path) + ".json"]
    )  # no temporary file left
    worker.serve(lib, req, clock=clock, byref=lambda p: p)
    assert len(lib.quantized) == 1  # reused
    with open(path, "ab") as f:
        f.write(b"tampered")
    worker.serve(lib, req, clock=clock, byref=lambda p: p)
    assert len(lib.quantized) == 2  # digest mismatch: made again
    assert open(path, "rb").read() == b"GGUF-source->32"
    lib.__version__ = "0.0-newer"
    worker.serve(lib, req, clock=clock, byref=lambda p: p)
    assert len(lib.quantized) == 3  # another llama.cpp version: made again


def test_failed_requantization_raises_and_leaves_nothing(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock, fail_quantize=True)
    with pytest.raises(RuntimeError, match="llama_model_quantize to q8_0 returned 1"):
        worker.serve(lib, request(source, tmp_path, precisions=("q8_0",)), clock=clock, byref=lambda p: p)
    assert os.listdir(tmp_path / "cache") == []


def test_unknown_precision_is_refused(source, tmp_path):
    lib = fake_llama_cpp(Clock())
    with pytest.raises(ValueError, match="q4_0"):
        worker.serve(lib, request(source, tmp_path, precisions=("q4_0",)), byref=lambda p: p)


def test_repeats_with_different_tokens_are_refused(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock)
    calls = {"n": 0}

    def drifting(sampler, ctx, idx):  # a nondeterministic engine: the timed run differs from the warm-up
        calls["n"] += 1
        return calls["n"]

    lib.llama_sampler_sample = drifting
    with pytest.raises(RuntimeError, match="greedy tokens differ"):
        worker.serve(lib, request(source, tmp_path, precisions=("f32",)), clock=clock, byref=lambda p: p)
    assert lib.freed == 1 and lib.closed == 1  # freed on failure too


def test_batched_rows_are_decoded_together_and_timed_apart(source, tmp_path):
    clock = Clock()
    lib = fake_llama_cpp(clock)
    req = request(source, tmp_path, precisions=("bf16",), new=4, repeats=2)
    req["batch_prompts"] = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    result = worker.serve(lib, req, clock=clock, byref=lambda p: p)["results"][0]
    batched = result["batched"]
    assert batched["batch"] == 3
    for row, last in zip(batched["tokens"], (3, 6, 9)):  # each row continues its own prompt by the greedy rule
        want = []
        for _ in range(4):
            last = next_token(last)
            want.append(last)
        assert row == want
    assert batched["prefill_samples"] == [9 * PREFILL_COST] * 2  # all 3 prompts in one call
    assert batched["decode_samples"] == [3 * DECODE_COST] * 2  # the other 3 steps, one call each for all rows
    (ctx,) = lib.contexts
    assert ctx.params.n_seq_max == 3 and ctx.params.n_ctx >= 3 * (3 + 4) and ctx.params.n_threads == 2
    assert lib.contexts_freed == 1 and lib.batches_freed == 1 and lib.freed == 2  # batch-1 and batched samplers
    assert result["tokens"] and len(result["prefill_samples"]) == 2  # the batch-1 run is still there


def test_batched_rows_of_different_lengths_are_refused(source, tmp_path):
    lib = fake_llama_cpp(Clock())
    req = request(source, tmp_path, precisions=("f32",))
    req["batch_prompts"] = [[1, 2], [3]]
    with pytest.raises(ValueError, match="one length"):
        worker.serve(lib, req, byref=lambda p: p)
    assert lib.quantized == [] and lib.loaded == [] and lib.contexts == []  # refused before any work

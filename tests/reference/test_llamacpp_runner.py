"""The llama.cpp runner's error paths and the benchmark's use of its answers, without llama.cpp: a missing or broken
interpreter is LlamaCppUnavailable (the benchmark skips llama.cpp, saying why); a failing worker is
LlamaCppWorkerError with its root cause; the real worker runs end to end against a stand-in `llama_cpp` module;
each llama.cpp phase is judged like ours and ratios ours/llama.cpp pair the same precision, never from an unreliable
timing."""

import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from experiments.benchmark.llamacpp import (
    agreement,
    agreement_lines,
    llamacpp_batches,
    llamacpp_precision,
    llamacpp_rates,
    make_runner,
)
from experiments.benchmark.table import summarize, throughput_table, timed_row
from experiments.benchmark.timing import judge
from hybridcache.reference.llamacpp_runner import (
    ENV,
    LlamaCppRunner,
    LlamaCppUnavailable,
    LlamaCppWorkerError,
    llamacpp_python,
)


def test_missing_interpreter_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(LlamaCppUnavailable, match=ENV):
        llamacpp_python(None)
    with pytest.raises(LlamaCppUnavailable, match="not on this machine"):
        llamacpp_python(str(tmp_path / "no-python"))
    with pytest.raises(LlamaCppUnavailable, match="cannot import llama_cpp"):
        llamacpp_python(sys.executable)  # ours: llama_cpp is never installed in this environment


def worker_script(tmp_path, body: str):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_worker_failure_is_a_named_error_with_its_cause(tmp_path):
    crash = worker_script(tmp_path, "raise MemoryError('cannot map the model')\n")
    runner = LlamaCppRunner(sys.executable, "x.gguf", tmp_path, worker=crash, check=False)
    with pytest.raises(LlamaCppWorkerError, match="MemoryError: cannot map the model"):
        runner.time_generation([1, 2], 4, 1, 3)
    refusal = worker_script(
        tmp_path, "import json, sys\njson.dump({'error': 'llama_cpp is not importable'}, open(sys.argv[2], 'w'))\n"
    )
    runner = LlamaCppRunner(sys.executable, "x.gguf", tmp_path, worker=refusal, check=False)
    with pytest.raises(LlamaCppWorkerError, match="not importable"):
        runner.time_generation([1, 2], 4, 1, 3)
    slow = worker_script(tmp_path, "import time\ntime.sleep(30)\n")
    runner = LlamaCppRunner(sys.executable, "x.gguf", tmp_path, timeout=1, worker=slow, check=False)
    with pytest.raises(LlamaCppWorkerError, match="no answer within 1 s"):
        runner.time_generation([1, 2], 4, 1, 3)


STAND_IN = '''
"""A stand-in llama_cpp: copies files for quantization; its greedy model continues with (last + 1) % 50."""
import ctypes
__version__ = "stand-in"
LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_BF16 = 0, 7, 32
class _P(ctypes.Structure):
    _fields_ = [("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool), ("nthread", ctypes.c_int)]
def llama_model_quantize_default_params():
    return _P()
def llama_model_quantize(src, dst, params):
    assert params._obj.allow_requantize  # passed by reference, as llama_cpp's ctypes signature wants
    open(dst, "wb").write(open(src, "rb").read() + bytes([params._obj.ftype]))
    return 0
class Llama:
    def __init__(self, model_path, **kw):
        self.tokens, self._ctx, self._model = [], type("C", (), {})(), type("M", (), {"model": "model"})()
        self._ctx.ctx = self
    def reset(self):
        self.tokens = []
    def eval(self, tokens):
        self.tokens += list(tokens)
def llama_sampler_init_greedy():
    return None
def llama_sampler_sample(sampler, ctx, idx):
    return (ctx.tokens[-1] + 1) % 50
def llama_sampler_free(sampler):
    pass
class _Ctx:  # a context of several sequences: the last batch's tokens, read back by index
    tokens = []
def llama_context_default_params():
    return type("Params", (), {})()
def llama_init_from_model(model, params):
    return _Ctx()
class _Batch(ctypes.Structure):  # llama.cpp's struct layout: pointer fields written through ctypes
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("pos", ctypes.POINTER(ctypes.c_int32)), ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))), ("logits", ctypes.POINTER(ctypes.c_int8))]
def llama_batch_init(n, embd, seq_max):
    b = _Batch()
    b._keep = [(ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_int8 * n)()]
    b._ids = [(ctypes.c_int32 * 1)() for _ in range(n)]
    kinds = [ctypes.POINTER(ctypes.c_int32)] * 3 + [ctypes.POINTER(ctypes.c_int8)]
    b.token, b.pos, b.n_seq_id, b.logits = [ctypes.cast(a, k) for a, k in zip(b._keep, kinds)]
    b.seq_id = (ctypes.POINTER(ctypes.c_int32) * n)(*[ctypes.cast(i, ctypes.POINTER(ctypes.c_int32)) for i in b._ids])
    return b
def llama_get_memory(ctx):
    return ctx
def llama_memory_clear(mem, data):
    pass
def llama_decode(ctx, batch):
    ctx.tokens = [batch.token[i] + 100 * batch.seq_id[i][0] for i in range(batch.n_tokens)]
    return 0
def llama_batch_free(batch):
    pass
def llama_free(ctx):
    pass
_single = llama_sampler_sample
def llama_sampler_sample(sampler, ctx, idx):
    return _single(sampler, ctx, idx) if isinstance(ctx, Llama) else (ctx.tokens[idx] + 1) % 50
'''


def test_the_real_worker_runs_end_to_end_on_a_stand_in_module(tmp_path, monkeypatch):
    """The JSON path runner -> worker -> answer, the worker's own main and ctypes.byref, in a subprocess."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "llama_cpp.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    runner = LlamaCppRunner(sys.executable, source, tmp_path / "cache", check=False)
    batch = [[48, 9, 49], [1, 2, 3]]
    results = runner.time_generation([48, 9, 49], 3, 1, 3, precisions=("f32", "q8_0"), batch_prompts=batch)
    assert runner.version == "stand-in"
    for r, ftype in zip(results, (0, 7)):
        assert r["tokens"] == [0, 1, 2]  # 49 -> 0 -> 1 -> 2
        # the stand-in reads the sequence id back through the ctypes pointers: row 1 is offset by 100
        assert r["batched"]["tokens"] == [[0, 1, 2], [4, 5, 6]]  # 3 -> (3 + 100 + 1) % 50 = 4 -> ...
        assert len(r["prefill_samples"]) == len(r["decode_samples"]) == 3
        assert open(r["model"], "rb").read() == b"GGUF" + bytes([ftype])


CRASHES_WITH_EXTRA_BUFFERS = """
import os, signal, sys
class _Params:
    use_extra_bufts = True
def llama_model_default_params():
    return _Params()
llama_cpp = sys.modules[__name__]  # the module Llama() reads its defaults from (llama_cpp.llama_cpp in the package)
_init = Llama.__init__
def _crashing_init(self, model_path, **kw):
    if llama_cpp.llama_model_default_params().use_extra_bufts:  # AMX in a VM that does not grant it, say
        os.kill(os.getpid(), signal.SIGSEGV)
    _init(self, model_path, **kw)
Llama.__init__ = _crashing_init
"""


def test_a_llamacpp_that_crashes_with_its_extra_buffers_runs_without_them(tmp_path, monkeypatch):
    """llama.cpp's AMX / repacked-weight buffers died with SIGSEGV on a Xeon VM: the runner runs it once more
    without them and says so (rows carry the note; the agreement lines print it once)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "llama_cpp.py").write_text(STAND_IN + CRASHES_WITH_EXTRA_BUFFERS)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    runner = LlamaCppRunner(sys.executable, source, tmp_path / "cache", check=False)
    results = runner.time_generation([48, 9, 49], 3, 1, 3, precisions=("q8_0",))
    assert results[0]["tokens"] == [0, 1, 2]
    assert "signal 11" in runner.note and "without them" in runner.note
    b = OmegaConf.create({"prompt_tokens": 3, "new_tokens": 3, "repeats": 3})
    rows = llamacpp_rates(runner, b, {1: [[48, 9, 49]]}, {"int8": "q8_0"}, {("int8", 1): [[0, 1, 2]]}, 1, 0.25)
    lines = agreement_lines(rows)
    assert lines[0] == runner.note and "agree 3/3" in lines[1]


def test_benchmark_skips_llamacpp_saying_why(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    said = []
    other = OmegaConf.create({"model_name": "jamba", "model": {"checkpoint": None}, "reference": {"python": None}})
    assert make_runner(other, "ckpt", said.append) is None
    gemma = OmegaConf.create({"model_name": "gemma3_270m", "model": {"checkpoint": "x"}, "reference": {"python": None}})
    assert make_runner(gemma, "ckpt", said.append) is None
    assert len(said) == 2 and "Gemma 3 270M GGUF only" in said[0] and ENV in said[1]


def test_precisions_pair_our_formats():
    assert llamacpp_precision(None, "float32") == "f32"
    assert llamacpp_precision("bfloat16", "float32") == "bf16"
    assert llamacpp_precision("int8", "float32") == "q8_0"
    assert llamacpp_precision("q8_0", "float32") == "q8_0"
    assert llamacpp_precision("int4", "float32") is None


class FakeRunner:
    version = "fake"

    def __init__(self, answers):
        self.answers, self.asked = answers, None

    def time_generation(self, prompt, new_tokens, threads, repeats, precisions, batch_prompts=None):
        self.asked = (list(prompt), new_tokens, threads, repeats, list(precisions))
        self.batch_prompts = batch_prompts
        return [{"precision": p, **self.answers[p]} for p in precisions]


def test_llamacpp_rows_are_judged_and_paired_with_ours_at_the_same_precision():
    b = OmegaConf.create({"prompt_tokens": 4, "new_tokens": 5, "repeats": 1})
    answers = {
        "f32": {"prefill_samples": [0.2] * 3, "decode_samples": [0.5] * 3, "tokens": [1, 2, 3, 4, 5]},
        "q8_0": {"prefill_samples": [0.1] * 3, "decode_samples": [0.1, 0.9, 0.3], "tokens": [1, 2, 9, 4, 5]},
    }
    runner = FakeRunner(answers)
    formats = {None: "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": None}
    answers["bf16"] = answers["f32"]
    ours_tokens = {(None, 1): [[1, 2, 3, 4, 5]], ("int8", 1): [[1, 2, 3, 4, 5]]}
    rows = llamacpp_rates(runner, b, {1: [[7, 8, 9, 10]]}, formats, ours_tokens, threads=2, max_spread=0.25)
    assert runner.asked == ([7, 8, 9, 10], 5, 2, 3, ["f32", "bf16", "q8_0"])  # at least 3 repeats, no int4
    assert runner.batch_prompts is None  # batch 1 only: no batched run asked for
    f32, bf16, q8 = rows
    assert f32["prefill_tok_s"] == pytest.approx(4 / 0.2) and f32["decode_tok_s"] == pytest.approx(4 / 0.5)
    assert f32["tokens_agree"] == 5 and f32["first_divergence"] is None
    assert bf16["tokens_agree"] is None  # no tokens of ours in that format
    assert q8["decode_tok_s"] is None and "spread" in q8["decode_unreliable"]
    assert q8["tokens_agree"] == 4 and q8["first_divergence"] == 2
    lines = agreement_lines(rows)
    assert "agree 5/5" in lines[0] and "first difference at new token 2" in lines[2]

    def ours(fmt, prefill, decode):
        label = f"ours (eager{f', {fmt} weights' if fmt else ''})"
        row = timed_row(label, 1, 4, 5, judge([prefill] * 3, 0.25), judge([decode] * 3, 0.25))
        return {**row, "weights_format": fmt}

    hf = timed_row("hf", 1, 4, 5, judge([0.4] * 3, 0.25), judge([1.0] * 3, 0.25))
    summary = summarize([ours(None, 0.1, 0.25), ours("int8", 0.05, 0.2), hf, *rows], {}, [], 0.0, 0.0)
    assert summary["prefill_speedup_vs_llamacpp/ours_eager/b1"] == pytest.approx(0.2 / 0.1)
    assert summary["decode_speedup_vs_llamacpp/ours_eager/b1"] == pytest.approx(0.5 / 0.25)
    assert summary["prefill_speedup_vs_llamacpp/ours_eager_int8_weights/b1"] == pytest.approx(0.1 / 0.05)
    assert summary["decode_speedup_vs_llamacpp/ours_eager_int8_weights/b1"] is None  # llama.cpp's decode: too spread
    assert "llama.cpp (q8_0)" in summary["decode_speedup_vs_llamacpp_unreliable/ours_eager_int8_weights/b1"]
    assert summary["decode_speedup_vs_hf/ours_eager/b1"] == pytest.approx(1.0 / 0.25)  # HF's ratios unchanged
    table, _ = throughput_table([ours(None, 0.1, 0.25), hf, *rows], summary)
    headers = [c.header for c in table.columns]
    assert headers.index("prefill vs llama.cpp") == headers.index("prefill vs HF") + 1
    assert headers.index("decode vs llama.cpp") == headers.index("decode vs HF") + 1


def test_agreement_counts_a_shorter_run_as_diverging():
    assert agreement([[1, 2, 3]], [[1, 2]]) == {"tokens_agree": 2, "tokens_compared": 3, "first_divergence": 2}


def test_agreement_over_rows_reports_the_earliest_difference_of_any_row():
    ours, theirs = [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 0, 4], [5, 0, 7, 8]]
    assert agreement(ours, theirs) == {"tokens_agree": 6, "tokens_compared": 8, "first_divergence": 1}
    with pytest.raises(ValueError, match="rows"):
        agreement(ours, theirs[:1])


def test_batched_llamacpp_rows_pair_with_ours_at_that_batch():
    b = OmegaConf.create({"prompt_tokens": 2, "new_tokens": 3, "repeats": 3, "batch_sizes": [1, 4, 8]})
    assert llamacpp_batches(b) == [1, 8] and llamacpp_batches(OmegaConf.create({"batch_sizes": [1]})) == [1]
    batched = {"batch": 2, "prefill_samples": [0.4] * 3, "decode_samples": [0.5] * 3, "tokens": [[1, 2, 3], [4, 5, 9]]}
    answers = {
        "f32": {"prefill_samples": [0.1] * 3, "decode_samples": [0.2] * 3, "tokens": [1, 2, 3], "batched": batched}
    }
    runner = FakeRunner(answers)
    prompts = {1: [[7, 8]], 2: [[7, 8], [9, 10]]}
    ours_tokens = {(None, 1): [[1, 2, 3]], (None, 2): [[1, 2, 3], [4, 5, 6]]}
    rows = llamacpp_rates(runner, b, prompts, {None: "f32"}, ours_tokens, threads=2, max_spread=0.25)
    assert runner.asked[0] == [7, 8] and runner.batch_prompts == [[7, 8], [9, 10]]
    one, two = rows
    assert (one["batch"], two["batch"]) == (1, 2) and one["tokens_agree"] == 3
    assert two["prefill_tok_s"] == pytest.approx(2 * 2 / 0.4) and two["decode_tok_s"] == pytest.approx(2 * 2 / 0.5)
    assert two["tokens_agree"] == 5 and two["tokens_compared"] == 6 and two["first_divergence"] == 2
    assert "batch 2" in agreement_lines(rows)[1] and "agree 5/6" in agreement_lines(rows)[1]
    ours = timed_row("ours (eager)", 2, 2, 3, judge([0.2] * 3, 0.25), judge([1.0] * 3, 0.25))
    summary = summarize([{**ours, "weights_format": None}, *rows], {}, [], 0.0, 0.0)
    assert summary["prefill_speedup_vs_llamacpp/ours_eager/b2"] == pytest.approx(0.4 / 0.2)
    assert summary["decode_speedup_vs_llamacpp/ours_eager/b2"] == pytest.approx(0.5 / 1.0)

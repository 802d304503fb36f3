"""Reference answers read like any file we read (issue "Reliability, second pass", item 7): a live reference's worker
answer (the JSON the vLLM subprocess writes) and a recorded JSONL (`reference=file`) are checked field by field.
Each forged input must raise a named error (ReferenceAnswerError for a live worker's garbage: the reference failed;
MalformedGeneration / RecordingMismatch for a recording: the user's file) and change nothing: no runner state, no
byte of the recording.

Before: a truncated answer was a bare JSONDecodeError, a missing key a KeyError, a string token id ("5") or a NaN
logprob went through to the comparison, a wrong number of results was cut short by zip, and a recording was checked
against this run by its first line only (a second line of another model's was replayed)."""

import copy
import json
import math
import sys
import textwrap

import pytest

from hybridcache.reference import FileRunner, Generation, ReferenceAnswerError, write_jsonl
from hybridcache.reference.vllm_runner import VLLMRunner, read_answer, timings_from_answer
from tests.hostile.kit import files_unchanged, report, rng, run_cases

PROMPTS = [[5, 6, 7], [8, 9]]
MAX_NEW, TOP_K = 3, 2


def good_results() -> list[dict]:
    return [
        Generation(
            p, [11, 12, 13], [-0.1, -0.2, -0.3], [{11: -0.1, 4: -2.0}, {12: -0.2, 4: -3.0}, {13: -0.3, 4: -1.5}]
        ).to_json()
        for p in PROMPTS
    ]


def good_answer() -> dict:
    return {"results": good_results(), "engine_seconds": 12.5, "generate_seconds": 0.5}


def forged_answers() -> list[tuple[str, object]]:
    """(description, a worker's answer: a dict to serialise or raw bytes)."""
    cases: list[tuple[str, object]] = []
    text = json.dumps(good_answer()).encode()
    r = rng("reference answers")
    for cut in sorted(r.sample(range(1, len(text) - 1), 24)) + [0]:
        cases.append((f"answer cut at byte {cut} of {len(text)}", text[:cut]))
    cases += [
        ("not UTF-8", b'{"results": "\xff\xfe"}'),
        ("a JSON array", b"[1, 2]"),
        ("a JSON string", b'"ok"'),
        ("null", b"null"),
        ("deeply nested", b"[" * 100_000 + b"]" * 100_000),
    ]

    def edit(description, change):
        answer = good_answer()
        change(answer)
        cases.append((description, answer))

    def result(i, key, value):
        return lambda a: a["results"][i].__setitem__(key, value)

    edit("error that is not a message", lambda a: a.__setitem__("error", {"code": 1}))
    edit("no results", lambda a: a.pop("results"))
    edit("results not a list", lambda a: a.__setitem__("results", {"0": a["results"][0]}))
    edit("one result for two prompts", lambda a: a["results"].pop())
    edit("three results for two prompts", lambda a: a["results"].append(a["results"][0]))
    edit("no results at all", lambda a: a.__setitem__("results", []))
    edit("results in the wrong order", lambda a: a["results"].reverse())
    edit("a result that is a list", lambda a: a["results"].__setitem__(0, [1, 2]))
    edit("a result that is null", lambda a: a["results"].__setitem__(1, None))
    for key in ("prompt", "tokens", "token_logprobs", "top_logprobs"):
        edit(f"a result without {key}", lambda a, key=key: a["results"][0].pop(key))
        edit(f"{key} a string", result(0, key, "[1, 2, 3]"))
        edit(f"{key} null", result(0, key, None))
    edit("an empty prompt", result(0, "prompt", []))
    edit("string token ids", result(0, "tokens", ["11", "12", "13"]))
    edit("string prompt ids", result(1, "prompt", ["8", "9"]))
    edit("float token ids", result(0, "tokens", [11.0, 12.0, 13.0]))
    edit("bool token ids", result(0, "tokens", [True, False, True]))
    edit("a negative token id", result(0, "tokens", [11, -1, 13]))
    edit("more tokens than max_new_tokens", result(0, "tokens", [11, 12, 13, 14]))
    for bad in (math.nan, math.inf, -math.inf, "-0.5", None, 3.0, True, [-0.5]):
        edit(f"token logprob {bad!r}", lambda a, bad=bad: a["results"][0]["token_logprobs"].__setitem__(1, bad))
        edit(f"top logprob {bad!r}", lambda a, bad=bad: a["results"][1]["top_logprobs"][0].__setitem__("4", bad))
    edit("fewer logprobs than tokens", lambda a: a["results"][0]["token_logprobs"].pop())
    edit("fewer top-k steps than tokens", lambda a: a["results"][1]["top_logprobs"].pop())
    edit("fewer tokens than steps", lambda a: a["results"][1]["tokens"].pop())
    edit("an empty top-k step", lambda a: a["results"][0]["top_logprobs"].__setitem__(0, {}))
    edit("a top-k step that is a list", lambda a: a["results"][0]["top_logprobs"].__setitem__(0, [[11, -0.1]]))
    for key in ("abc", "-1", "1.5", "", " 4", "\u0664"):
        edit(f"top-k key {key!r}", lambda a, key=key: a["results"][0]["top_logprobs"][2].__setitem__(key, -4.0))
    for bad in (-1.0, math.nan, math.inf, "0.5", None):
        edit(f"seconds {bad!r}", result(0, "seconds", bad))
    edit("meta a list", result(0, "meta", ["vllm"]))
    for bad in (None, -1.0, math.nan, math.inf, "12.5", False):
        edit(f"engine_seconds {bad!r}", lambda a, bad=bad: a.__setitem__("engine_seconds", bad))
    edit("no engine_seconds", lambda a: a.pop("engine_seconds"))
    return cases


def ask(runner, answer):
    """The runner's generate() with the worker's answer file holding `answer` (the JSON path, without a process)."""
    data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()

    def fake_ask(request):
        assert request["prompts"] == PROMPTS
        return read_answer(data, 0)

    runner._ask = fake_ask
    return runner.generate(PROMPTS, MAX_NEW, TOP_K)


@pytest.fixture
def runner(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"]}))
    return VLLMRunner(sys.executable, str(ckpt), platform="cpu", timeout=60)


def test_forged_worker_answers_are_refused_by_name(runner):
    assert ask(runner, good_answer())[1].tokens == [11, 12, 13] and runner.engine_seconds == 12.5  # the control
    runner.engine_seconds = 0.0
    cases = [(d, lambda a=a: ask(runner, a)) for d, a in forged_answers()]

    def unchanged():
        return None if runner.engine_seconds == 0.0 else f"engine_seconds became {runner.engine_seconds}"

    problems = run_cases("reference answers", cases, unchanged)
    assert len(cases) >= 95 and not problems, report(problems, len(cases))


def forged_timings() -> list[tuple[str, dict]]:
    batches, repeats = [[[1, 2]], [[1, 2], [3, 4]]], 3

    def good():
        return {
            "timings": [{"batch": len(b), "prefill_samples": [0.1] * 3, "decode_samples": [0.2] * 3} for b in batches],
            "engine_seconds": 3.0,
        }

    cases = []

    def edit(description, change):
        answer = good()
        change(answer)
        cases.append((description, answer))

    edit("no timings", lambda a: a.pop("timings"))
    edit("one timing for two batches", lambda a: a["timings"].pop())
    edit("timings a dict", lambda a: a.__setitem__("timings", {"0": 1}))
    edit("a timing for another batch size", lambda a: a["timings"][1].__setitem__("batch", 1))
    edit("batch size a string", lambda a: a["timings"][0].__setitem__("batch", "1"))
    edit("batch size true", lambda a: a["timings"][0].__setitem__("batch", True))
    edit("a timing that is a list", lambda a: a["timings"].__setitem__(0, [1]))
    for phase in ("prefill_samples", "decode_samples"):
        edit(f"{phase} missing", lambda a, p=phase: a["timings"][0].pop(p))
        edit(f"{phase} short", lambda a, p=phase: a["timings"][1][p].pop())
        for bad in (math.nan, -0.1, math.inf, "0.1", None):
            edit(f"{phase} sample {bad!r}", lambda a, p=phase, bad=bad: a["timings"][1][p].__setitem__(2, bad))
    edit("engine_seconds missing", lambda a: a.pop("engine_seconds"))
    return [(d, batches, repeats, a) for d, a in cases]


def test_forged_timing_answers_are_refused_by_name(runner):
    def timed(answer, batches, repeats):
        runner._ask = lambda request: read_answer(json.dumps(answer).encode())
        return runner.time_batches(batches, 4, repeats)

    forged = forged_timings()
    _, batches, repeats, _ = forged[0]
    good = {
        "timings": [{"batch": len(b), "prefill_samples": [0.1] * 3, "decode_samples": [0.2] * 3} for b in batches],
        "engine_seconds": 3.0,
    }
    assert timings_from_answer(good, batches, repeats) == good["timings"]  # the control
    cases = [(d, lambda b=b, n=n, a=a: timed(a, b, n)) for d, b, n, a in forged]
    problems = run_cases("reference answers", cases)
    assert not problems, report(problems, len(cases))


FAKE_WORKER = textwrap.dedent("""
    import os, sys
    if __name__ == "__main__":
        with open(sys.argv[2], "wb") as f:
            f.write(open(os.environ["FAKE_ANSWER"], "rb").read())
""")


@pytest.mark.parametrize(
    "description,answer,message",
    [
        ("truncated", json.dumps(good_answer()).encode()[:100], r"not JSON \(100 bytes, worker exit status 0"),
        ("one result", {**good_answer(), "results": good_results()[:1]}, "answered 1 results for 2 prompts"),
        ("NaN", json.dumps(good_answer()).replace("-0.2", "NaN", 1).encode(), "finite log-probability"),
    ],
)
def test_a_worker_process_answering_garbage(tmp_path, monkeypatch, description, answer, message):
    """The whole path through a real subprocess (a fake worker that writes the forged answer)."""
    worker, forged = tmp_path / "worker.py", tmp_path / "answer.json"
    worker.write_text(FAKE_WORKER)
    forged.write_bytes(answer if isinstance(answer, bytes) else json.dumps(answer).encode())
    monkeypatch.setenv("FAKE_ANSWER", str(forged))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"]}))
    runner = VLLMRunner(sys.executable, str(ckpt), platform="cpu", worker=worker, timeout=60)
    with pytest.raises(ReferenceAnswerError, match=message):
        runner.generate(PROMPTS, MAX_NEW, TOP_K)


# -- recordings (reference=file) ----------------------------------------------------------------------------------
IDENTITY = {
    "model_type": "mamba2",
    "weights": "0123456789abcdef",
    "dtype": "float32",
    "packed_weights": None,
    "max_new_tokens": 3,
    "top_k": 2,
    "eos_token_id": 0,
}
META = {**IDENTITY, "checkpoint": "/ckpt", "source": "hf"}


def good_lines() -> list[dict]:
    return [{**r, "meta": dict(META)} for r in good_results()]


def forged_recordings() -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []

    def lines(rows) -> bytes:
        return "".join(json.dumps(r) + "\n" for r in rows).encode()

    def edit(description, change):
        rows = copy.deepcopy(good_lines())
        change(rows)
        cases.append((description, lines(rows)))

    for key, other in [
        ("model_type", "jamba"),
        ("weights", "fedcba9876543210"),
        ("dtype", "bfloat16"),
        ("packed_weights", "int8"),
        ("max_new_tokens", 8),
        ("top_k", 5),
        ("eos_token_id", 1),
        ("source", "vllm"),
    ]:  # the first line is this run's: only the second differs
        edit(f"line 2 with {key}={other!r}", lambda rows, k=key, v=other: rows[1]["meta"].__setitem__(k, v))
    edit("line 2 without its identity", lambda rows: rows[1].__setitem__("meta", {}))
    for key, bad in [
        ("max_new_tokens", "8"),
        ("max_new_tokens", 0),
        ("top_k", True),
        ("top_k", 2.0),
        ("weights", 5),
        ("model_type", None),
        ("eos_token_id", "0"),
        ("plan", "full"),
        ("plan", [1, 2]),
        ("checkpoint", ["/ckpt"]),
    ]:
        edit(f"meta.{key}={bad!r} on line 1", lambda rows, k=key, v=bad: rows[0]["meta"].__setitem__(k, v))
    edit("meta a string", lambda rows: rows[0].__setitem__("meta", "hf"))
    edit("string token ids", lambda rows: rows[1].__setitem__("tokens", ["11", "12", "13"]))
    edit("string prompt ids", lambda rows: rows[0].__setitem__("prompt", ["5", "6", "7"]))
    edit("NaN logprob", lambda rows: rows[1]["token_logprobs"].__setitem__(0, math.nan))
    edit("infinite top logprob", lambda rows: rows[1]["top_logprobs"][1].__setitem__("4", -math.inf))
    edit("missing tokens", lambda rows: rows[1].pop("tokens"))
    edit("missing top_logprobs", lambda rows: rows[0].pop("top_logprobs"))
    edit("lengths that disagree", lambda rows: rows[1]["token_logprobs"].pop())
    edit(
        "the same prompt twice, generated differently",
        lambda rows: rows.append({**copy.deepcopy(rows[0]), "tokens": [4, 12, 13]}),
    )
    good = lines(good_lines())
    cases += [
        ("last line cut short", good[:-20]),
        ("a line that is not JSON", good + b"not json\n"),
        ("a line that is a JSON array", good + b"[1, 2, 3]\n"),
        ("not UTF-8", good + b'{"prompt": "\xff"}\n'),
        ("empty", b""),
        ("blank lines only", b"\n \n\t\n"),
        ("deeply nested line", good + b"[" * 100_000 + b"]" * 100_000 + b"\n"),
    ]
    return cases


def test_forged_recordings_are_refused_by_name(tmp_path):
    good = tmp_path / "good.jsonl"
    write_jsonl(good, [Generation.from_json(r) for r in good_results()], META)
    assert FileRunner(good, expect=IDENTITY, prompts=PROMPTS).generate(PROMPTS, 3, 2)[1].prompt == [8, 9]  # control
    cases = []
    for n, (description, data) in enumerate(forged_recordings()):
        path = tmp_path / f"forged{n}.jsonl"
        path.write_bytes(data)
        cases.append((description, lambda p=path: FileRunner(p, expect=IDENTITY, prompts=PROMPTS)))
    problems = run_cases("recordings", cases, files_unchanged(tmp_path))
    assert len(cases) >= 35 and not problems, report(problems, len(cases))

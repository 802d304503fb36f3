"""Our decoding-time modes against kvpress 0.5.5's DecodingPress / PrefillDecodingPress, and the runner that runs them.

Without kvpress: the runner's reading of forged answers. With HYBRIDCACHE_KVPRESS_PYTHON and the real Gemma 3 270M:
kvpress's bisected keep count against ours, then each offered method live (a 400-token English prompt, 32 tokens
teacher-forced one per forward, 16 tokens greedy): the same compression steps on all 18 layers, the same kept
positions after every compression (any difference first appears on pairs our own scores call a float tie), the
same NLL until a difference can act, the same greedy tokens. And kvpress's StreamingLLM under DecodingPress keeping
neither sinks nor the most recent tokens from its second compression on (its slots are in topk order by then),
which is why ours follows the method there, not kvpress.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from hybridcache.cache.methods.press_schedule import decoding_kept_count
from hybridcache.reference import kvpress_runner
from hybridcache.reference.kvpress_decoding import DECODING_PRESSES, read_decoding_answer, run_decoding_press
from hybridcache.reference.kvpress_runner import WORKER, KvpressWorkerError

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 100}
T_CTX, T_CONT = 10, 6


def test_decoding_press_names_match_the_worker():
    tree = ast.parse(WORKER.read_text())
    names = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DECODING_PRESSES"
    )
    assert tuple(ast.literal_eval(names)) == DECODING_PRESSES
    from hybridcache.cache import available_layers, get_layer_class

    offered = {n for n in available_layers() if getattr(get_layer_class(n).spec_cls, "decodes", False)}
    assert offered == set(DECODING_PRESSES)  # the modes we offer are the ones checked live


def test_bad_requests_are_refused_before_any_work(tmp_path):
    for kwargs, words in (
        (dict(press="snapkv"), "no decoding check for press 'snapkv'"),
        (dict(press="tova", schedule="continuous"), "schedule must be one of"),
        (dict(press="tova", budget=0), "budget must be a positive integer"),
        (dict(press="tova", compression_interval=True), "compression_interval must be a positive integer"),
        (dict(press="tova", greedy=-1), "greedy must be a non-negative integer"),
        (dict(press="tova", compression_ratio=0.5), "compression_ratio is the prefill's"),
        (dict(press="tova", schedule="prefill_decoding"), "compression_ratio is the prefill's"),
    ):
        args = {"press": "tova", "budget": 4, "compression_interval": 2, **kwargs}
        with pytest.raises(ValueError, match=words):
            run_decoding_press(tmp_path, [1, 2], [3], python="/nonexistent", **args)


# --- forged answers, read as the runner reads them -------------------------------------------------------------


def good_files():
    held = torch.tensor([[0, 1, 8, 12, 15]])
    tensors = {"held.0": held, "held.1": held.clone(), "nll": torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 0.5])}
    tensors |= {"event.0.0": torch.tensor([[0, 1, 8, 11]]), "event.0.1": torch.tensor([[0, 1, 8, 12]])}
    tensors["greedy"] = torch.tensor([5, 6, 7])
    meta = {"versions": {"kvpress": "0.5.5"}, "events": {"0": [1, 3]}, "mean_nll": float(tensors["nll"].mean())}
    return {"meta": meta}, tensors


def read_forged(tmp_path, answer, tensors, schedule="decoding", greedy=3):
    ans, res = tmp_path / "answer.json", tmp_path / "result.safetensors"
    ans.write_text(json.dumps(answer))
    save_file({k: v.clone() for k, v in tensors.items()}, str(res))
    return read_decoding_answer(ans, res, "tova", schedule, T_CTX, T_CONT, greedy, CONFIG)


def test_a_well_formed_answer_is_read(tmp_path):
    result = read_forged(tmp_path, *good_files())
    assert (
        result.ok and [s for s, _ in result.events[0]] == [1, 3] and result.events[0][1][1].tolist() == [[0, 1, 8, 12]]
    )
    assert result.held[1].tolist() == [[0, 1, 8, 12, 15]] and result.greedy.tolist() == [5, 6, 7]
    assert math.isclose(float(result.nll.mean()), 1.0, rel_tol=1e-6)


def forge(change):
    answer, tensors = good_files()
    change(answer, tensors)
    return answer, tensors


FORGERIES = {
    "position past the continuation": (
        forge(lambda a, t: t.update({"held.0": torch.tensor([[0, 16]])})),
        "in \\[0, 16\\)",
    ),
    "unsorted positions": (forge(lambda a, t: t.update({"event.0.1": torch.tensor([[1, 0, 8, 12]])})), "ascending"),
    "wrong heads": (forge(lambda a, t: t.update({"held.1": torch.tensor([[0], [1]])})), "int64 \\[1, n\\]"),
    "layer beyond the model": (forge(lambda a, t: t.update({"held.2": t["held.0"]})), "unexpected tensor 'held.2'"),
    "stray tensor": (forge(lambda a, t: t.update({"kept.0": t["held.0"]})), "unexpected tensor 'kept.0'"),
    "missing layer": (forge(lambda a, t: t.pop("held.1")), "lacks the held positions"),
    "event without a step": (forge(lambda a, t: a["meta"].update({"events": {"0": [1]}})), "steps and tensors"),
    "event of an unnamed layer": (forge(lambda a, t: t.update({"event.1.0": t["event.0.0"]})), "does not name"),
    "step outside the continuation": (forge(lambda a, t: a["meta"].update({"events": {"0": [1, 6]}})), "outside"),
    "prefill step without a prefill press": (
        forge(lambda a, t: a["meta"].update({"events": {"0": [-1, 3]}})),
        "outside",
    ),
    "steps not increasing": (forge(lambda a, t: a["meta"].update({"events": {"0": [3, 3]}})), "not increasing"),
    "greedy short": (forge(lambda a, t: t.update({"greedy": torch.tensor([5, 6])})), "int64 \\[3\\]"),
    "greedy outside the vocabulary": (
        forge(lambda a, t: t.update({"greedy": torch.tensor([5, 6, 100])})),
        "vocabulary",
    ),
    "nan nll": (forge(lambda a, t: t.update({"nll": torch.full((6,), math.nan)})), "non-finite"),
    "mean disagrees": (forge(lambda a, t: a["meta"].update({"mean_nll": 3.0})), "mean_nll disagrees"),
    "worker refusal": (forge(lambda a, t: a.update({"error": "press 'x' has no", "kind": "worker"})), "refused"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_results_are_refused(tmp_path, case):
    (answer, tensors), message = FORGERIES[case]
    with pytest.raises(KvpressWorkerError, match=message):
        read_forged(tmp_path, answer, tensors)


def test_a_prefill_step_is_read_for_prefill_decoding(tmp_path):
    answer, tensors = forge(lambda a, t: a["meta"].update({"events": {"0": [-1, 3]}}))
    assert [s for s, _ in read_forged(tmp_path, answer, tensors, schedule="prefill_decoding").events[0]] == [-1, 3]


# --- live: kvpress 0.5.5 on Gemma 3 270M -----------------------------------------------------------------------

KVPRESS_PYTHON = os.environ.get(kvpress_runner.ENV_VAR)


def _real_path():
    from hybridcache.checkpoints.real import _target

    path = _target("gemma3_270m")
    return path if (path / "config.json").is_file() else None


REAL = _real_path()
needs_kvpress = pytest.mark.skipif(
    not KVPRESS_PYTHON,
    reason=f"needs {kvpress_runner.ENV_VAR} (a kvpress 0.5.5 environment: {kvpress_runner.install_commands()})",
)
live = pytest.mark.skipif(
    not KVPRESS_PYTHON or REAL is None,
    reason=f"needs {kvpress_runner.ENV_VAR} (a kvpress 0.5.5 environment: {kvpress_runner.install_commands()}) "
    "and the converted Gemma 3 270M (real_checkpoint('gemma3_270m'))",
)
CONTEXT, CONTINUATION, GREEDY = 400, 32, 16


@needs_kvpress
def test_the_keep_count_is_kvpress_s_own():
    """press_schedule's transcription of DecodingPress._find_target_compression_ratio + compute_n_kept against the
    installed kvpress, on pairs where its bisection lands on the target and where it misses (budget + 1)."""
    pairs = [(17, 16), (416, 256), (272, 256), (1000, 999), (4097, 3), (1891981, 308201), (1772258, 399254)]
    code = (
        "import json, sys\n"
        "from kvpress import DecodingPress, KnormPress\n"
        "from kvpress.utils import compute_n_kept\n"
        "p = DecodingPress(base_press=KnormPress())\n"
        "out = []\n"
        "for k, t in json.loads(sys.argv[1]):\n"
        "    r = p._find_target_compression_ratio(k, t)\n"
        "    out.append(k if r == 0 else compute_n_kept(k, r))\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([KVPRESS_PYTHON, "-c", code, json.dumps(pairs)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert [decoding_kept_count(k, t) for k, t in pairs] == theirs
    assert theirs[-2:] == [308202, 399255]  # the misses are real: kvpress keeps one more there


@pytest.fixture(scope="module")
def setup():
    import hybridcache as hc
    from experiments.core.common import load_tokenizer
    from experiments.study.data import documents

    model = hc.from_pretrained(REAL, dtype=torch.float32)
    tokenizer = load_tokenizer(str(REAL))
    doc = documents(tokenizer, "pydoc", CONTEXT + CONTINUATION, 1, model.vocab_size)[0]
    return model, doc[:CONTEXT], doc[CONTEXT:]


# (method, schedule, budget, interval, ratio, kvpress's compression steps in the continuation)
CASES = [
    ("tova", "decoding", 256, 8, None, [7, 15, 23, 31]),
    ("knorm", "decoding", 256, 8, None, [7, 15, 23, 31]),
    ("streaming_llm", "decoding", 256, 24, None, [23]),  # one compression: kvpress's later ones scramble (below)
    ("tova", "prefill_decoding", 128, 8, 0.5, [-1, 7, 15, 23, 31]),
    ("knorm", "prefill_decoding", 128, 8, 0.5, [-1, 7, 15, 23, 31]),
]


@live
@pytest.mark.parametrize("method,schedule,budget,interval,ratio,steps", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_ours_keeps_what_kvpress_decoding_press_keeps(setup, method, schedule, budget, interval, ratio, steps):
    from hybridcache.reference.press_check import check_decoding_press

    model, context, continuation = setup
    check = check_decoding_press(
        model, REAL, context, continuation, method, schedule, budget, interval, ratio, greedy=GREEDY
    )
    assert check.reference_error is None, check.reference_error
    assert check.same_steps and sorted(check.per_step) == steps
    assert check.compressions == 18 * len(steps)  # every layer, sliding ones included, at each of those steps
    # kept sets: equal, or first apart on pairs our own scores call a float tie (knorm: one token twice at layer
    # 0, rotary keeps the norm); later differences follow from that one (the next layers' keys change)
    assert check.not_ties == 0, (check.first_differing_step, check.per_step)
    assert check.kept_agreement == 1.0 if check.differing == 0 else check.kept_agreement > 0.99
    assert check.max_token_nll_diff_before < 1e-4, (check.ours_nll, check.reference_nll)
    assert check.differing or check.max_token_nll_diff < 1e-4
    assert check.greedy_same == GREEDY, (check.greedy_ours, check.greedy_reference)


@live
def test_kvpress_streaming_llm_keeps_neither_sinks_nor_recent_tokens_after_its_first_decoding_compression(setup):
    """kvpress 0.5.5 ScorerPress.compress gathers the kept slots in topk order (NVIDIA/kvpress#173), and
    StreamingLLMPress scores slots by index: from the second compression on, its "sinks" and "window" are whatever
    landed in the first and last slots. If this fails, kvpress fixed it: compare ours over several compressions."""
    _, context, continuation = setup
    result = run_decoding_press(REAL, context, continuation, "streaming_llm", 256, 16, n_sink=4)
    assert result.ok, result.error
    for layer, events in result.events.items():
        (first_step, first), (second_step, second) = events[:2]
        assert (first_step, second_step) == (15, 31)
        method = torch.cat([torch.arange(4), torch.arange(CONTEXT + first_step + 1 - 252, CONTEXT + first_step + 1)])
        assert torch.equal(first[0], method), layer  # the first: sinks + the 252 most recent, as the method says
        expected = torch.cat(
            [torch.arange(4), torch.arange(CONTEXT + second_step + 1 - 252, CONTEXT + second_step + 1)]
        )
        assert not torch.equal(second[0], expected), layer


# --- experiment=press_check: the decoding-time cases -------------------------------------------------------------


def test_press_check_composes_the_decoding_cases_and_refuses_bad_ones_by_name(monkeypatch):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from experiments.core.common import UserError
    from experiments.press_check.main import decoding_cases, run

    configs = Path(__file__).resolve().parents[2] / "configs"

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(configs), version_base=None):
            return compose(config_name="config", overrides=["experiment=press_check", *overrides])

    cases = decoding_cases(cfg().experiment)
    assert {c["method"] for c in cases} == set(DECODING_PRESSES)
    assert {c["schedule"] for c in cases} == {"decoding", "prefill_decoding"}
    monkeypatch.delenv(kvpress_runner.ENV_VAR, raising=False)  # the refusal must come before the environment check
    for override, words in (
        ("experiment.decoding=[{method: snapkv}]", r"experiment.decoding\[0\]: method 'snapkv' has no decoding"),
        ("experiment.decoding=[{method: tova, schedule: continuous}]", "schedule must be one of"),
        ("experiment.decoding=[{method: tova, budget: 0}]", "budget must be a positive integer"),
        ("experiment.decoding=[{method: tova, compression_ratio: 0.5}]", "prefill_decoding only"),
        ("experiment.decoding=[{method: tova, schedule: prefill_decoding, compression_ratio: 1.5}]", r"\[0, 1\)"),
    ):
        with pytest.raises(UserError, match=words):
            run(cfg("experiment.methods=[]", override))


def test_press_check_writes_the_decoding_rows(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """The app around the check (run.py in this process, a tiny model, the check itself replaced: its numbers are
    the live tests' business): the decoding table printed, press_check.json holding every case, exit status 0 with
    no prefill methods at all."""
    import sys
    from pathlib import Path

    from hydra.core.global_hydra import GlobalHydra

    import experiments
    import experiments.press_check.main as app
    import run
    from hybridcache.reference.press_check import DecodingCheck

    seen = []

    def fake_check(model, checkpoint, context, continuation, method, schedule, budget, compression_interval, **kw):
        seen.append((method, schedule, budget, compression_interval, kw.get("compression_ratio"), len(context)))
        return DecodingCheck(
            method, schedule, budget, compression_interval, kw.get("compression_ratio"), "kvpress 0.5.5 (faked)",
            2.5, 2.5, 1e-6, 1.0, 18, True, 1.0, 0, 0, None, 1e-6, [1, 2], [1, 2],
        )  # fmt: skip

    monkeypatch.setattr(app, "check_decoding_press", fake_check)
    monkeypatch.setenv(kvpress_runner.ENV_VAR, sys.executable)  # only its presence is checked before the work
    home = os.environ.get("HYBRIDCACHE_TEST_HOME") or str(tmp_path_factory.getbasetemp() / "hybridcache-home")
    monkeypatch.setenv("HYBRIDCACHE_HOME", home)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "unused"))
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    GlobalHydra.instance().clear()
    experiments.EXIT.code = 0
    out = tmp_path / "out"
    cases = "[{method: tova, budget: 8, compression_interval: 2},{method: knorm, schedule: prefill_decoding, compression_ratio: 0.5, budget: 4, compression_interval: 3}]"  # noqa: E501
    args = ["experiment=press_check", "model=gemma3", "experiment.methods=[]", f"experiment.decoding={cases}"]
    monkeypatch.setattr(sys, "argv", ["run.py", *args, "experiment.context=24", "experiment.continuation=8"])
    sys.argv.append(f"hydra.run.dir={out}")
    run.main()
    printed = capsys.readouterr().out
    assert experiments.EXIT.code == 0, printed[-3000:]
    assert seen == [("tova", "decoding", 8, 2, None, 24), ("knorm", "prefill_decoding", 4, 3, 0.5, 24)]
    result = json.loads((out / "press_check.json").read_text())
    assert [r["method"] for r in result["decoding_rows"]] == ["tova", "knorm"] and result["rows"] == []
    assert "decoding-time presses" in printed and "│ prefill_decoding │" in printed
    assert "press_check: gemma3" not in printed  # no prefill methods: no empty table

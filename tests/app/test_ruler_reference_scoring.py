"""Our RULER scoring (experiments/long_context/ruler_constants.py) against independent code, read at test time (never
copied):

- lm-eval's port of RULER (lm_eval/tasks/ruler/*.py of the lm-eval wheel on PyPI; .ci/run downloads it with
  `pip download --no-deps lm-eval==0.4.13 -d /tmp/hybridcache-ci-lm-eval`, or set HYBRIDCACHE_LM_EVAL to a wheel or
  an unpacked directory): its postprocess_pred and string_match_all score every task's samples and adversarial
  answers; its templates, needle, noise and the eight niah tasks' settings are compared with ours (read by ast: the
  modules import datasets, wonderwords and nltk, which never run here).
- RULER's own code, from a checkout of NVIDIA/RULER named by HYBRIDCACHE_RULER_DIR (scripts/eval/synthetic/
  constants.py and evaluate.py's postprocess_pred): the same comparisons. Not in CI (no copy of RULER's code ships
  here); docs/long_context.md records a run of it.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest
import transformers

from experiments.long_context import ruler
from experiments.long_context.ruler_constants import CWE, FWE, NEEDLE, NIAH, REPEAT, TOKENS_TO_GENERATE, VT
from experiments.long_context.ruler_reference import ReferenceScoringError, lm_eval_scoring, ruler_scoring

TOK = transformers.ByT5Tokenizer()
LM_EVAL_DEFAULT = Path("/tmp/hybridcache-ci-lm-eval")


def lm_eval_path() -> Path | None:
    given = os.environ.get("HYBRIDCACHE_LM_EVAL")
    if given:
        return Path(given)
    wheels = sorted(LM_EVAL_DEFAULT.glob("lm_eval-*.whl"))
    return wheels[-1] if wheels else None


LM_EVAL = lm_eval_path()
RULER_DIR = os.environ.get("HYBRIDCACHE_RULER_DIR")
needs_lm_eval = pytest.mark.skipif(
    LM_EVAL is None,
    reason="lm-eval's wheel is not here: pip download --no-deps lm-eval==0.4.13 -d /tmp/hybridcache-ci-lm-eval "
    "(what .ci/run does), or set HYBRIDCACHE_LM_EVAL",
)


def oracles() -> list:
    params = [pytest.param("lm-eval", marks=needs_lm_eval)]
    params.append(
        pytest.param(
            "ruler",
            marks=pytest.mark.skipif(
                not RULER_DIR, reason="HYBRIDCACHE_RULER_DIR (a checkout of NVIDIA/RULER) is not set"
            ),
        )
    )
    return params


def load(name: str):
    return lm_eval_scoring(LM_EVAL) if name == "lm-eval" else ruler_scoring(RULER_DIR)


def adversarial(answers: list[str]) -> list[str]:
    """Answers a model might give: right, empty, partial, in another case, wrapped in text, with control characters,
    reordered, cut short, split by a newline, with a digit changed."""
    first = answers[0]
    return [
        " ".join(answers),
        "",
        "   \n\t ",
        first,
        " ".join(answers).upper(),
        " ".join(answers).swapcase(),
        f"Sure! The answer is: {', '.join(answers)}. Hope that helps.",
        "\x00" + "\x1f".join(answers) + "\x07",
        " ".join(reversed(answers)),
        first[:-1],
        first[: len(first) // 2] + "\n" + first[len(first) // 2 :],
        first[:-1] + ("0" if first[-1] != "0" else "1"),
        "\u00a0" + first + "\u2028",  # unicode spaces: not control characters, so they stay
        first * 3,
    ]


def samples() -> list:
    out = []
    for task in ruler.TASKS:
        for seed in (0, 1):
            out.append(ruler.ruler_sample(TOK, task, 1800, 0.5, seed=seed))
    return out


SAMPLES = samples()


@pytest.mark.parametrize("oracle", oracles())
def test_every_sample_and_adversarial_answer_scores_as_the_reference(oracle):
    ref = load(oracle)
    count = 0
    for s in SAMPLES:
        for pred in adversarial(s.answers):
            assert ruler.score(s.task, pred, s.answers) == ref.score(s.task, pred, s.answers), (s.task, pred)
            assert ruler.postprocess(pred) == ref.postprocess(pred)
            count += 1
    assert count == len(ruler.TASKS) * 2 * 14


@pytest.mark.parametrize("oracle", oracles())
def test_a_whole_task_set_scores_as_the_reference(oracle):
    """RULER scores a task's file at once: the mean over samples, rounded once (not a mean of rounded scores)."""
    ref = load(oracle)
    for task in ruler.TASKS:
        mine = [s for s in SAMPLES if s.task == task]
        preds = [ruler.postprocess(p) for s in mine for p in adversarial(s.answers)]
        refs = [s.answers for s in mine for _ in adversarial(s.answers)]
        kind = ruler.TASKS[task]["task"]
        assert ruler.METRICS[kind](preds, refs) == ref.metrics[kind](preds, refs), task


@pytest.mark.skipif(not RULER_DIR, reason="HYBRIDCACHE_RULER_DIR (a checkout of NVIDIA/RULER) is not set")
def test_string_match_part_as_rulers():
    ref = ruler_scoring(RULER_DIR)
    preds, refs = ["Paris, or Lyon", "rome", "", "OSLO!"], [["paris", "lyon"], ["x"], ["a"], ["oslo", "y"]]
    assert ruler.string_match_part(preds, refs) == ref.metrics["qa"](preds, refs)


@needs_lm_eval
def test_the_adversarial_answers_catch_a_wrong_scorer():
    """The comparison can fail: a case-sensitive match disagrees with the reference on some adversarial answer of
    every task whose answers have letters, and an all-or-nothing match on every task with several answers."""
    ref = load("lm-eval")
    for s in SAMPLES:
        preds = adversarial(s.answers)
        expected = [ref.score(s.task, p, s.answers) for p in preds]
        sensitive = [round(sum(a in p for a in s.answers) / len(s.answers) * 100, 2) for p in preds]
        assert (sensitive != expected) == any(c.isalpha() for a in s.answers for c in a), s.task
        strict = [100.0 * all(a.lower() in p.lower() for a in s.answers) for p in preds]
        assert (strict != expected) == (len(s.answers) > 1), s.task


def _lm_eval_source(name: str) -> str:
    rel = f"lm_eval/tasks/ruler/{name}"
    if LM_EVAL.suffix == ".whl":
        with zipfile.ZipFile(LM_EVAL) as whl:
            return whl.read(rel).decode()
    return (LM_EVAL / rel).read_text()


def _assigned(source: str, name: str):
    """The literal value assigned to a module-level `name` (or a name anywhere, for NEEDLE inside functions)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned")


@needs_lm_eval
def test_templates_needle_and_noise_are_the_references():
    vt = _assigned(_lm_eval_source("vt_utils.py"), "CONFIG")["variable_tracking"]
    assert (vt["template"], vt["answer_prefix"]) == VT
    assert vt["tokens_to_generate"] == TOKENS_TO_GENERATE["variable_tracking"]
    cwe = _assigned(_lm_eval_source("cwe_utils.py"), "CONFIG")
    assert (cwe["template"], cwe["answer_prefix"]) == CWE
    assert cwe["tokens_to_generate"] == TOKENS_TO_GENERATE["common_words_extraction"]
    fwe = _assigned(_lm_eval_source("fwe_utils.py"), "CONFIG")
    assert (fwe["template"], fwe["answer_prefix"]) == FWE
    assert fwe["tokens_to_generate"] == TOKENS_TO_GENERATE["freq_words_extraction"]
    assert _assigned(_lm_eval_source("niah_utils.py"), "TEMPLATE") == NIAH[0]
    prepare = _lm_eval_source("prepare_niah.py")
    assert _assigned(prepare, "NEEDLE") == NEEDLE
    assert REPEAT in prepare and REPEAT + "\\n" in _lm_eval_source("vt_utils.py")  # vt's noise line


@needs_lm_eval
def test_the_eight_niah_tasks_have_the_references_settings():
    """Each niah_* function of lm-eval's niah_utils.py calls generate_samples with the task's haystack, key and value
    types and needle counts (RULER's synthetic.yaml); ours must be the same, missing counts meaning 1."""
    tree = ast.parse(_lm_eval_source("niah_utils.py"))
    found = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("niah_"):
            call = next(
                n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "generate_samples"
            )
            kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg.startswith(("type_", "num_needle"))}
            found[fn.name] = {"task": "niah", "num_needle_k": 1, "num_needle_v": 1, "num_needle_q": 1, **kw}
    ours = {t: a for t, a in ruler.TASKS.items() if a["task"] == "niah"}
    assert found == ours


def test_a_wrong_reference_directory_is_a_named_error(tmp_path):
    with pytest.raises(ReferenceScoringError, match="is not a file"):
        ruler_scoring(tmp_path)
    (tmp_path / "scripts/eval/synthetic").mkdir(parents=True)
    (tmp_path / "scripts/eval/synthetic/constants.py").write_text("TASKS = {}\n")
    (tmp_path / "scripts/eval/evaluate.py").write_text("import nemo_that_is_not_installed\n")
    with pytest.raises(ReferenceScoringError, match="no function postprocess_pred"):
        ruler_scoring(tmp_path)
    with pytest.raises(ReferenceScoringError, match="holds no|is not a file"):
        lm_eval_scoring(tmp_path)

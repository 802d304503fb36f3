"""The oracles our RULER scoring (experiments/long_context/ruler_constants.py) is checked against, read at run time,
never copied:

- RULER's own code, from a checkout of NVIDIA/RULER: scripts/eval/synthetic/constants.py (string_match_all,
  string_match_part, TASKS[kind]['metric_fn']) run as it is, and scripts/eval/evaluate.py's postprocess_pred. That
  file imports nltk, pandas and NeMo at module level, so only the postprocess_pred function is compiled, from the
  file's own source text (ast), with `re` in its namespace.
- lm-eval's port (lm_eval/tasks/ruler/common_utils.py of the lm-eval wheel on PyPI, a directory or the .whl itself):
  postprocess_pred and string_match_all as RULER's but without the x100 and rounding, which are applied here. Its
  string_match_part is not RULER's (lm-eval 0.4.13 takes the max over samples, not over references), so `qa` has no
  lm-eval metric; no task here uses it.

`experiment.reference_scoring=/path/to/RULER` re-scores every answer of experiment=long_context with RULER's code;
tests/app/test_ruler_reference_scoring.py compares the two on every task's samples and on adversarial answers.
"""

from __future__ import annotations

import ast
import re
import runpy
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.core.errors import UserError
from experiments.long_context.ruler_constants import TASKS

RULER_CONSTANTS = "scripts/eval/synthetic/constants.py"
RULER_EVALUATE = "scripts/eval/evaluate.py"
LM_EVAL_COMMON = "lm_eval/tasks/ruler/common_utils.py"


class ReferenceScoringError(UserError, ValueError):
    """The reference scoring code cannot be found or read (a wrong directory, a file that lacks the function)."""


@dataclass(frozen=True)
class ReferenceScoring:
    source: str  # where the code was read from
    postprocess: Callable[[str], str]
    metrics: dict[str, Callable[[list[str], list[list[str]]], float]]  # RULER task kind -> 0-100, 2 decimals

    def score(self, task: str, pred: str, answers: list[str]) -> float:
        """One sample's score as the reference computes it: postprocess, then the task kind's metric."""
        kind = TASKS[task]["task"]
        if kind not in self.metrics:
            raise ReferenceScoringError(f"{self.source} has no metric for RULER's '{kind}' tasks")
        return self.metrics[kind]([self.postprocess(pred)], [answers])


def _function(source: str, name: str, where: str) -> Callable:
    """Function `name` of a module's source, compiled alone (the module's own imports never run)."""
    tree = ast.parse(source, filename=where)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not nodes:
        raise ReferenceScoringError(f"{where} defines no function {name}")
    namespace: dict = {"re": re}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), where, "exec"), namespace)  # noqa: S102 - the oracle's code
    return namespace[name]


def _read(path: Path) -> str:
    if not path.is_file():
        raise ReferenceScoringError(f"{path} is not a file (a RULER checkout has {RULER_CONSTANTS})")
    return path.read_text()


def ruler_scoring(root: str | Path) -> ReferenceScoring:
    """RULER's own scoring from a checkout of NVIDIA/RULER at `root`."""
    root = Path(root).expanduser()
    constants = root / RULER_CONSTANTS
    _read(constants)
    tasks = runpy.run_path(str(constants)).get("TASKS")  # RULER's file: plain functions and a dict, no imports
    if not isinstance(tasks, dict):
        raise ReferenceScoringError(f"{constants} defines no TASKS dict")
    evaluate = root / RULER_EVALUATE
    post = _function(_read(evaluate), "postprocess_pred", str(evaluate))
    return ReferenceScoring(
        f"RULER ({root})", lambda p: post(p, {}), {kind: t["metric_fn"] for kind, t in tasks.items()}
    )


def lm_eval_scoring(where: str | Path) -> ReferenceScoring:
    """lm-eval's port of RULER's scoring from an unpacked lm-eval wheel (a directory holding lm_eval/) or the .whl."""
    where = Path(where).expanduser()
    if where.is_file() and where.suffix == ".whl":
        with zipfile.ZipFile(where) as whl:
            try:
                source = whl.read(LM_EVAL_COMMON).decode()
            except KeyError:
                raise ReferenceScoringError(f"{where} holds no {LM_EVAL_COMMON}") from None
    else:
        source = _read(where / LM_EVAL_COMMON)
    post = _function(source, "postprocess_pred", f"{where}/{LM_EVAL_COMMON}")  # list[str] -> list[str]
    match_all = _function(source, "string_match_all", f"{where}/{LM_EVAL_COMMON}")  # a mean in [0, 1]

    def metric(preds: list[str], refs: list[list[str]]) -> float:
        return round(match_all(preds, refs) * 100, 2)  # RULER's scale: x100, two decimals

    kinds = {t["task"] for t in TASKS.values()}
    return ReferenceScoring(f"lm-eval ({where})", lambda p: post([p])[0], dict.fromkeys(kinds, metric))

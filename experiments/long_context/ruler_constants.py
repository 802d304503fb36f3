"""RULER's constants (Hsieh et al. 2024): the task templates, answer prefixes and tokens to generate
(scripts/data/synthetic/constants.py), the task settings (scripts/synthetic.yaml) and the scoring
(scripts/eval/synthetic/constants.py), kept apart from experiments/long_context/ruler.py's prompt builders."""

from __future__ import annotations

import re
from collections.abc import Callable

# -- RULER's templates (scripts/data/synthetic/constants.py), answer prefixes, tokens to generate ----------------
NIAH = (
    (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for "
        "{query} mentioned in the provided text?"
    ),
    " The special magic {type_needle_v} for {query} mentioned in the provided text are",
)
VT = (
    (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
        "Find all variables that are assigned the value {query} in the text above."
    ),
    # RULER's own spelling ("assgined"): models are compared on RULER's exact prompt
    (
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined "
        "the value {query}, they are: "
    ),
)
CWE = (
    (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
        "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
    ),
    " Answer: The top 10 words that appear most often in the list are:",
)
FWE = (
    (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    ),
    " Answer: According to the coded text above, the three most frequently appeared words are:",
)
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> dict:
    return {
        "task": "niah",
        "type_haystack": haystack,
        "type_needle_k": k,
        "type_needle_v": v,
        "num_needle_k": nk,
        "num_needle_v": nv,
        "num_needle_q": nq,
    }


# RULER's scripts/synthetic.yaml
TASKS: dict[str, dict] = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": {"task": "variable_tracking", "num_chains": 1, "num_hops": 4},
    "cwe": {"task": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"task": "freq_words_extraction", "alpha": 2.0},
}


# -- RULER's scoring (scripts/eval/evaluate.py postprocess_pred, scripts/eval/synthetic/constants.py) -----------------
def postprocess(pred: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, the ends are stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Per sample, the share of references found (case-insensitive substrings); mean x 100, rounded to 2 places."""
    score = sum(sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """Per sample, 1 when any reference is found (case-insensitive substring); mean x 100, rounded to 2 places."""
    score = sum(max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


METRICS: dict[str, Callable[[list[str], list[list[str]]], float]] = {
    "niah": string_match_all,
    "variable_tracking": string_match_all,
    "common_words_extraction": string_match_all,
    "freq_words_extraction": string_match_all,
    "qa": string_match_part,
}


def metric_name(task: str) -> str:
    return METRICS[TASKS[task]["task"]].__name__


def score(task: str, pred: str, answers: list[str]) -> float:
    """One sample's score in [0, 100] under the task's RULER metric (unrounded means come from these)."""
    return METRICS[TASKS[task]["task"]]([postprocess(pred)], [answers])

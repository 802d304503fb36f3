"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"), generated offline at an exact prompt length in tokens, with RULER's templates and scoring.

Tasks and their settings are RULER's (scripts/synthetic.yaml): needle in a haystack (single 1-3, multikey 1-3,
multivalue, multiquery), variable tracking (vt), common-words (cwe) and frequent-words (fwe) extraction. Prompts are
RULER's "base" template: the task template followed by its answer prefix, which the model continues. Scoring is RULER's
(scripts/eval/synthetic/constants.py): string_match_all for every task here, string_match_part for its QA tasks.

Where this differs from RULER, and why:
- Offline sources: the "essay" haystack is the Python reference's English text (study_data's `pydoc`) instead of
  Paul Graham's essays, from a seeded start; the words (niah keys, cwe words) are the lowercase words of that text
  instead of the `wonderwords` lists. The repeated-noise haystack and vt's noise are RULER's own sentences.
- Exact length: RULER fills whole haystack units up to max_seq_length - tokens_to_generate; here the prompt (bos
  included) has exactly `length` tokens: units are tokenized one by one and the haystack is cut at the token level
  (niah/vt: the excerpt starts inside its first unit; cwe/fwe: the list ends inside its last item).
- Depth: the queried needle (the first answer's) sits at the unit boundary nearest the requested depth of the
  haystack; other needles (distractor keys, further values/queries) at seeded random depths, as RULER places them.
  vt, cwe and fwe have no depth (RULER places vt's chain at random).
- vt's one-shot example is at most min(500, length // 4) tokens (RULER: 500, for prompts of 4k and more); its template
  is the task template (RULER's base template drops the word before the answer prefix there).
- fwe's answer is the three most frequent words of the list as cut (RULER's vocab[1:4], the same unless the cut
  swapped two counts).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from experiments.long_context.ruler_constants import (  # noqa: F401 - scoring re-exported: ruler.score, ruler.metric_name
    CWE,
    FWE,
    METRICS,
    NEEDLE,
    NIAH,
    REPEAT,
    TASKS,
    TOKENS_TO_GENERATE,
    VT,
    metric_name,
    postprocess,
    score,
    string_match_all,
    string_match_part,
)
from experiments.study.data import encode, text_source, with_bos


# -- offline sources -------------------------------------------------------------------------------------------------
@functools.cache
def essay_sentences() -> tuple[str, ...]:
    """The pydoc text as sentences, whitespace collapsed (RULER: re.sub(r'\\s+', ' ', essay), then sent_tokenize)."""
    flat = re.sub(r"\s+", " ", text_source("pydoc")).strip()
    return tuple(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat) if s)


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """The distinct lowercase words (3-12 letters) of the pydoc text, in a fixed shuffled order (about 2.7k)."""
    words = sorted(set(re.findall(r"\b[a-z]{3,12}\b", text_source("pydoc"))))
    random.Random(0).shuffle(words)
    return tuple(words)


def distinct_words(rng: random.Random, n: int) -> list[str]:
    """n distinct words; hyphenated pairs once the vocabulary runs out (long cwe lists)."""
    vocab = vocabulary()
    if n <= len(vocab):
        return rng.sample(vocab, n)
    return [f"{vocab[i % len(vocab)]}-{vocab[i // len(vocab)]}" for i in rng.sample(range(len(vocab) ** 2), n)]


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":  # RULER: 7 digits
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # RULER: adjective-noun
        return "-".join(rng.sample(vocabulary(), 2))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type '{kind}'")


# -- exact-length filling --------------------------------------------------------------------------------------------
def fill(
    tokenizer, units: Iterator[str], sep: str, budget: int, inserts: list[tuple[float, str]], trim: str = "start"
) -> tuple[list[int], list[int]]:
    """Exactly `budget` context ids: haystack units (each tokenized with `sep` before it) cut at the token level
    (`trim`: 'start' cuts into the first unit, 'end' into the last), with each insert (depth, text) at the unit
    boundary nearest its depth of the haystack (in list order where two share one). Also each insert's offset."""
    pieces_in = [encode(tokenizer, sep + text) for _, text in inserts]
    need = budget - sum(map(len, pieces_in))
    if need < 0:
        raise ValueError(f"no room for the haystack: {budget} tokens for the needles' {budget - need}")
    pieces, total = [], 0
    while total < need:
        ids = encode(tokenizer, sep + next(units))
        pieces.append(ids)
        total += len(ids)
    excess = total - need
    if trim == "start":
        while pieces and excess >= len(pieces[0]):
            excess -= len(pieces.pop(0))
        if pieces:
            pieces[0] = pieces[0][excess:]
    elif excess:
        pieces[-1] = pieces[-1][:-excess]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + len(p))
    at: dict[int, list[int]] = {}
    for i, (depth, _) in enumerate(inserts):
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        b = min(range(len(bounds)), key=lambda j: abs(bounds[j] - depth * need))
        at.setdefault(b, []).append(i)
    ids, offsets = [], [0] * len(inserts)
    for j in range(len(pieces) + 1):
        for i in at.get(j, []):
            offsets[i] = len(ids)
            ids += pieces_in[i]
        if j < len(pieces):
            ids += pieces[j]
    return ids, offsets


def _cycle(items, start: int) -> Iterator[str]:
    while True:
        for i in range(start, len(items)):
            yield items[i]
        start = 0


@dataclass(frozen=True)
class RulerSample:
    task: str
    length: int  # requested prompt tokens (bos included) == len(ids)
    depth: float | None  # of the queried needle (niah); None for vt, cwe, fwe
    ids: list[int]
    answers: list[str]  # what RULER's metric looks for in the generated text
    max_new_tokens: int  # RULER's tokens_to_generate for the task
    needle_offsets: list[int]  # where each inserted needle (or vt's chain link) starts in ids


def _assemble(tokenizer, template: str, length: int, build: Callable[[int], tuple[list[int], list[int]]], **fields):
    head, tail = template.format(context="\0", **fields).split("\0")
    head_ids = with_bos(tokenizer, encode(tokenizer, head))
    tail_ids = encode(tokenizer, tail)
    budget = length - len(head_ids) - len(tail_ids)
    if budget <= 0:
        raise ValueError(f"a prompt of {length} tokens is too short for the template ({length - budget} tokens)")
    context, offsets = build(budget)
    return head_ids + context + tail_ids, [len(head_ids) + o for o in offsets]


def niah(tokenizer, task: str, length: int, depth: float, rng: random.Random) -> RulerSample:
    a = TASKS[task]
    kind_v = a["type_needle_v"]
    nk = max(a["num_needle_k"], a["num_needle_q"])
    keys = [_random(a["type_needle_k"], rng) for _ in range(nk)]
    values = [[_random(kind_v, rng) for _ in range(a["num_needle_v"])] for _ in keys]
    queried = sorted(rng.sample(range(nk), a["num_needle_q"]))
    needles = [
        (NEEDLE.format(type_needle_v=kind_v, key=k, value=v), ki) for ki, k in enumerate(keys) for v in values[ki]
    ]
    first = next(i for i, (_, ki) in enumerate(needles) if ki == queried[0])
    inserts = [(depth if i == first else rng.random(), text) for i, (text, _) in enumerate(needles)]
    queries = [keys[i] for i in queried]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, noun = NIAH[0] + NIAH[1], kind_v
    if a["num_needle_q"] * a["num_needle_v"] == 1:  # RULER's singular wording, replacements in its order
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        noun = kind_v[:-1]
    if a["type_haystack"] == "essay":
        sents = essay_sentences()
        units, sep = _cycle(sents, rng.randrange(len(sents))), " "
    elif a["type_haystack"] == "repeat":
        units, sep = _cycle([REPEAT], 0), "\n"
    else:  # "needle": distractor needles all the way
        units, sep = (
            (
                NEEDLE.format(type_needle_v=kind_v, key=_random(a["type_needle_k"], rng), value=_random(kind_v, rng))
                for _ in itertools.count()
            ),
            "\n",
        )
    ids, offsets = _assemble(
        tokenizer, template, length, lambda b: fill(tokenizer, units, sep, b, inserts), type_needle_v=noun, query=query
    )
    return RulerSample(
        task, length, depth, ids, [v for i in queried for v in values[i]], TOKENS_TO_GENERATE["niah"], offsets
    )


def _vt_prompt(tokenizer, length: int, rng: random.Random, hops: int, letters: int, prefix: list[int]):
    """vt's prompt of `length` tokens with `prefix` (the one-shot example) after bos; ids, chain offsets, names."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        names += [] if name in names else [name]
    value = str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): the high end excluded
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    inserts = list(zip(sorted(rng.random() for _ in chain), chain))  # RULER: sorted random positions
    ids, offsets = _assemble(
        tokenizer,
        VT[0] + VT[1],
        length - len(prefix),
        lambda b: fill(tokenizer, _cycle([REPEAT + "\n"], 0), " ", b, inserts),
        query=value,
        num_v=hops + 1,
    )
    nb = len(with_bos(tokenizer, []))
    return ids[:nb] + prefix + ids[nb:], [o + len(prefix) for o in offsets], names


def _vt_min_length(tokenizer, hops: int, letters: int) -> int:
    """About the shortest vt prompt: the template, the chain and one line of noise (a few tokens of slack)."""
    name = "Q" * letters
    fixed = (VT[0] + VT[1]).format(context=REPEAT, query="12345", num_v=hops + 1)
    chain = f" VAR {name} = 12345" + f" VAR {name} = VAR {name} " * hops
    return len(with_bos(tokenizer, encode(tokenizer, fixed + chain))) + 8


def variable_tracking(tokenizer, task: str, length: int, rng: random.Random) -> RulerSample:
    hops = TASKS[task]["num_hops"]
    # RULER's one-shot example: a shorter prompt (3-letter names), its answer, two blank lines, then the task
    shot_hops = min(10, hops)
    shot_length = max(min(500, length // 4), _vt_min_length(tokenizer, shot_hops, 3))
    shot, _, shot_names = _vt_prompt(tokenizer, shot_length, rng, shot_hops, 3, [])
    shot = shot[len(with_bos(tokenizer, [])) :]
    prefix = encode(tokenizer, " ") + shot + encode(tokenizer, " " + " ".join(shot_names) + "\n\n\n\n")
    ids, offsets, names = _vt_prompt(tokenizer, length, rng, hops, 5, prefix)
    return RulerSample(task, length, None, ids, names, TOKENS_TO_GENERATE["variable_tracking"], offsets)


def sized(items: Callable[[int], tuple[list[list[int]], list]], budget: int, n: int) -> tuple[list[int], list, int]:
    """A list cut to exactly `budget` tokens: `items(n)` (the tokenized items of a list built from n words, and the
    items) grows in proportion until it covers the budget, so the cut is small. Ids, items, items left whole."""
    while True:
        enc, listed = items(n)
        total = sum(map(len, enc))
        if total >= budget:
            break
        n = max(n + 1, math.ceil(n * budget / max(total, 1) * 1.02))
    ids, whole = [], 0
    for e in enc:
        if len(ids) + len(e) > budget:
            return ids + e[: budget - len(ids)], listed, whole
        ids += e
        whole += 1
    return ids, listed, whole


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def common_words(tokenizer, task: str, length: int, rng: random.Random) -> RulerSample:
    a = TASKS[task]
    num_cw = a["num_cw"]
    # RULER: below 4096 tokens, fewer repeats (6 and 1; the example 3 and 1), else freq_cw/freq_ucw (example 10, 3)
    (ex_n, ex_cw, ex_ucw), (cw, ucw) = (
        ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (a["freq_cw"], a["freq_ucw"]))
    )
    common: list[str] = []

    def listing(n: int, common_repeats: int, uncommon_repeats: int) -> list[str]:
        words = distinct_words(rng, n)
        common[:] = words[:num_cw]
        listed = words[:num_cw] * common_repeats + words[num_cw:] * uncommon_repeats
        rng.shuffle(listed)
        return listed

    example = CWE[0].format(context=_numbered(listing(ex_n, ex_cw, ex_ucw))) + CWE[1] + _numbered(common) + "\n"

    def items(n: int) -> tuple[list[list[int]], list[str]]:
        listed = listing(n, cw, ucw)
        texts = [f"{' ' if i else ''}{i + 1}. {w}" for i, w in enumerate(listed)]
        return tokenizer(texts, add_special_tokens=False)["input_ids"], listed

    def build(budget: int) -> tuple[list[int], list[int]]:
        ids, listed, whole = sized(items, budget, num_cw + 1)
        kept = Counter(listed[:whole])
        if min(kept[w] for w in common) <= ucw:  # the cut list must still say which words are common
            raise ValueError(f"a cwe prompt of {length} tokens is too short: its list holds {whole} words")
        return ids, []

    ids, _ = _assemble(tokenizer, example + CWE[0] + CWE[1], length, build)
    return RulerSample(task, length, None, ids, list(common), TOKENS_TO_GENERATE["common_words_extraction"], [])


def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta for alpha > 1 (scipy.special.zeta's value): a partial sum plus Euler-Maclaurin's tail."""
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


def frequent_words(tokenizer, task: str, length: int, rng: random.Random) -> RulerSample:
    alpha = TASKS[task]["alpha"]
    size = max(length // 50, 5)  # RULER: vocab_size = max_seq_length // 50 coded words of 6 letters
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    coded = sorted(vocab)
    rng.shuffle(coded)
    coded[0] = "..."  # RULER: the most frequent word is noise
    z = _zeta(alpha)
    answers: list[str] = []

    def items(n: int) -> tuple[list[list[int]], list[str]]:  # RULER: word k appears int(n k^-alpha / zeta(alpha)) times
        words = [w for k, w in enumerate(coded, 1) for _ in range(int(n * k**-alpha / z))]
        rng.shuffle(words)
        return tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"], words

    def build(budget: int) -> tuple[list[int], list[int]]:
        ids, words, whole = sized(items, budget, 8)
        kept = Counter(words[:whole])
        answers[:] = sorted((w for w in kept if w != "..."), key=lambda w: (-kept[w], coded.index(w)))[:3]
        return ids, []

    head, tail = FWE[0].split("{context}")  # RULER: "... coded words. {context}": the list starts after a space
    ids, _ = _assemble(tokenizer, head.rstrip(" ") + "{context}" + tail + FWE[1], length, build)
    return RulerSample(task, length, None, ids, answers, TOKENS_TO_GENERATE["freq_words_extraction"], [])


def ruler_sample(tokenizer, task: str, length: int, depth: float | None = None, seed: int | str = 0) -> RulerSample:
    """One RULER prompt of exactly `length` tokens (bos included), seeded: the same arguments, the same prompt."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task '{task}' (known: {', '.join(TASKS)})")
    rng = random.Random(f"{seed}/{task}/{length}/{depth}")
    kind = TASKS[task]["task"]
    if kind == "niah":
        return niah(tokenizer, task, length, 0.5 if depth is None else float(depth), rng)
    builder = {
        "variable_tracking": variable_tracking,
        "common_words_extraction": common_words,
        "freq_words_extraction": frequent_words,
    }[kind]
    return builder(tokenizer, task, length, rng)


def has_depth(task: str) -> bool:
    return TASKS[task]["task"] == "niah"

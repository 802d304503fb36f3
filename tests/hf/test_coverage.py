"""(a) Every entry of transformers' CausalLM mapping, on a tiny random checkpoint built with HF's own classes: the
bridge's native config gives HF's own cache's tokens and logits within 1e-4 (float32, greedy, a left-padded batch)
on every family HF itself generates with, except the gaps listed here with their reasons (each checked to still be
a gap, so a fix shows up). docs/hf_bridge.md carries the table `python -m hybridcache.hf.coverage --write
docs/hf_bridge.md` writes; its verdicts are checked against this file's expectations."""

import re
from pathlib import Path

import pytest

from hybridcache.hf.coverage import NOT_RUN, check_family, families

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf_bridge.md"

GAPS: dict[str, str] = {}  # family -> what its row's note says (none left: DeepSeek-V4 is covered)
# entries that are not targets: encoder-decoders, families whose generate keeps no Cache, and tiny checkpoints that
# do not run in HF (their config shrink fails or they need more than text); each with what the table says
NOT_TARGETS = {
    "encoder-decoder": "bart bigbird_pegasus blenderbot blenderbot-small marian mbart musicgen musicgen_melody mvp "
    "pegasus plbart prophetnet whisper",
    "keeps no Cache": "mpt openai-gpt rwkv xlnet",
    NOT_RUN: "blt cohere_compass_text dbrx dory dots3_note dots3_note_text gemma3n gemma4_assistant "
    "gemma4_unified_assistant inkling2_loop_text inkling2_text longcat_flash moss_transcribe_diarize phi4_multimodal "
    "qwen4_exp qwen4_exp_text reformer xlstm xmod",
}
NOT_TARGET = {family: why for why, names in NOT_TARGETS.items() for family in names.split()}
FAMILIES = families()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_config_equals_hf_own_cache(family):
    row = check_family(family, FAMILIES[family])
    if family in NOT_TARGET:
        assert not row.target and NOT_TARGET[family] in row.note, row.note
    elif family in GAPS:
        assert row.target and not row.covered and GAPS[family] in row.note, row.note
    else:
        assert row.covered, f"{family}: {row.note} (max abs d logit {row.max_dlogit})"


def test_the_docs_table_matches_these_expectations():
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in FAMILIES:
            rows[cells[0]] = cells
    assert set(rows) == set(FAMILIES), "docs/hf_bridge.md's table is stale: regenerate it"
    for family, (_, _, hf_runs, bridge_runs, equal, _, _, _) in rows.items():
        if family in NOT_TARGET:
            assert hf_runs == "no", family
        elif family in GAPS:
            assert hf_runs == "yes" and equal != "yes", family
        else:
            assert (hf_runs, bridge_runs, equal) == ("yes", "yes", "yes"), family
    head = next(line for line in DOCS.read_text().splitlines() if " families HF itself generates with" in line)
    covered = len(FAMILIES) - len(NOT_TARGET) - len(GAPS)
    assert re.match(rf"{covered} of {covered + len(GAPS)} families", head), head

"""The whole-model table (experiments/whole_model/main.py): production configs built by our family code on meta, bytes
from our Cache's accounting, checked against hand computations written out from the published shapes (not from our
files or our code): keys/values 2 x KV heads x head_dim x tokens x 2 bytes (bf16) per attention layer; conv
states channels x (kernel - 1) x 2 bytes; SSM / delta-rule states in float32; int8 / fp8 states one byte an element
plus one float32 scale per vector along the state's last axis."""

import json

import pytest

from experiments.whole_model import configs as production
from experiments.whole_model import main as wm
from experiments.whole_model.byte_counts import CONV, SSM

T32, T128 = 32768, 131072


def rows_of(name, tokens=(T32, T128)):
    return {r["tokens"]: r for r in wm.model_rows(production.build(name), tokens)}


def check(row, kv, conv, ssm, ssm_int8, kv_types=("kv_full",)):
    """The row against the hand numbers, part by part and in every saving it reports."""
    native = row["parts"]["native"]
    assert {k: v for k, v in native.items() if k.startswith("kv_")} == {kv_types[0]: kv}
    assert (native[CONV], native[SSM]) == (conv, ssm)
    total = kv + conv + ssm
    assert row["totals"]["native"] == total and row["kv_share"] == kv / total
    expect = {
        "kv_div4": kv // 4 + conv + ssm,  # a quarter of the tokens kept
        "state_bf16": kv + conv + ssm // 2,
        "state_fp8": kv + conv + ssm_int8,  # one byte per element plus the same float32 scales
        "state_int8": kv + conv + ssm_int8,
        "kv_div4+state_int8": kv // 4 + conv + ssm_int8,
    }
    for name, bytes_ in expect.items():
        assert row["totals"][name] == bytes_, name
        assert row["savings"][name] == pytest.approx(1 - bytes_ / total, abs=1e-15), name
    assert row["state_saving"]["kv_div4"] == 0 and row["kv_saving"]["state_int8"] == 0  # the other part untouched


def test_nemotron_h_8b_against_its_published_shapes():
    # nvidia/Nemotron-H-8B-Base-8K: 24 Mamba2 layers ("M"), 4 attention layers ("*"), 24 MLP layers ("-");
    # attention 8 KV heads x 128; Mamba2 128 heads x 64, 8 groups, state 128, conv kernel 4
    mamba, attention = 24, 4
    for t, row in rows_of("nemotron_h_8b").items():
        check(
            row,
            kv=attention * 2 * 8 * 128 * t * 2,
            conv=mamba * (128 * 64 + 2 * 8 * 128) * 3 * 2,  # conv over x, B and C
            ssm=mamba * 128 * 64 * 128 * 4,  # [heads, head_dim, state]
            ssm_int8=mamba * (128 * 64 * 128 + 128 * 64 * 4),  # a scale per (head, head_dim)
        )
    assert rows_of("nemotron_h_8b", [T32])[T32]["totals"]["native"] == 639_008_768  # 609.4 MiB, as the docs say


def test_falcon_h1_7b_every_layer_holds_both_caches():
    # tiiuae/Falcon-H1-7B: 44 layers, each attention (2 KV heads x 128) beside Mamba2 (24 heads x 128, 1 group,
    # state 256, conv kernel 4)
    layers = 44
    for t, row in rows_of("falcon_h1_7b").items():
        check(
            row,
            kv=layers * 2 * 2 * 128 * t * 2,
            conv=layers * (24 * 128 + 2 * 1 * 256) * 3 * 2,
            ssm=layers * 24 * 128 * 256 * 4,
            ssm_int8=layers * (24 * 128 * 256 + 24 * 128 * 4),
        )


def test_qwen3_5_27b_gated_deltanet_states():
    # Qwen/Qwen3.5-27B: 64 layers, every 4th full attention (4 KV heads x 256), the other 48 Gated DeltaNet
    # (16 key heads and 48 value heads of 128, conv kernel 4 over q, k and v; state [value heads, 128, 128])
    full, delta = 16, 48
    for t, row in rows_of("qwen3_5_27b").items():
        check(
            row,
            kv=full * 2 * 4 * 256 * t * 2,
            conv=delta * (2 * 16 * 128 + 48 * 128) * 3 * 2,
            ssm=delta * 48 * 128 * 128 * 4,
            ssm_int8=delta * (48 * 128 * 128 + 48 * 128 * 4),
        )


def test_jamba_mamba1_states():
    # ai21labs/Jamba-v0.1: 32 layers, attention every 8th from layer 4 (8 KV heads x 4096/32); Mamba inner size
    # 2 x 4096, state 16, conv kernel 4
    attention, mamba, inner = 4, 28, 2 * 4096
    for t, row in rows_of("jamba_v0_1").items():
        check(
            row,
            kv=attention * 2 * 8 * 128 * t * 2,
            conv=mamba * inner * 3 * 2,
            ssm=mamba * inner * 16 * 4,
            ssm_int8=mamba * (inner * 16 + inner * 4),
        )


FAST = ["qwen3_5_27b", "jamba_v0_1", "nemotron_h_8b", "nemotron_h_47b", "granite_4_0_h_small", "falcon_h1_7b"]


def test_the_committed_page_holds_what_the_command_computes_now():
    """docs/whole_model_savings.md is the command's output: its rows for the models that build in a second are what
    a fresh computation renders (a config or accounting change without regenerating the page fails here)."""
    page = wm.DOC.read_text()
    result = wm.compute(FAST, wm.TOKENS)
    lines = wm.holds_table(result["rows"])[2:] + wm.savings_table(result["rows"])[2:]
    assert len(lines) == 4 * len(FAST)
    missing = [line for line in lines if line not in page.splitlines()]
    assert not missing, "regenerate with python -m experiments.whole_model.main:\n" + "\n".join(missing)
    assert (wm.DOC.parent / "figures" / "whole_model_savings.png").stat().st_size > 10_000
    assert "(figures/whole_model_savings.png)" in page


def test_every_production_config_names_its_model_and_sources():
    for name in production.available():
        config = production.read(name)
        assert "/" in config["_model_id"] and config["_sources"], name
        assert isinstance(config["_unconfirmed"], list) and config["torch_dtype"] == "bfloat16", name


def test_the_command_writes_the_page_the_figure_and_json(tmp_path):
    out = tmp_path / "page.md"
    args = ["--models", "nemotron_h_8b", "--tokens", "1024", "--out", str(out), "--json", str(tmp_path / "r.json")]
    result = wm.main(args)
    page = out.read_text()
    assert "| Nemotron-H-8B | 1k |" in page and "![" in page and "(figures/whole_model_savings.png)" in page
    assert (tmp_path / "figures" / "whole_model_savings.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["totals"] == result["rows"][0]["totals"]


def test_bad_input_is_a_named_error_before_any_work(tmp_path):
    with pytest.raises(production.ProductionConfigError, match="no production config 'nope'.*known: falcon_h1_34b"):
        production.build("nope")
    for bad in ([0], [], [1.5], [True]):
        with pytest.raises(wm.WholeModelError, match="tokens must be positive integers"):
            wm.compute(["nemotron_h_8b"], bad)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "alien.json").write_text('{"model_type": "no_such_family"}')
    (tmp_path / "int_dtype.json").write_text('{"model_type": "jamba", "torch_dtype": "int8"}')
    with pytest.raises(production.ProductionConfigError, match="not a readable JSON config"):
        production.build("broken", tmp_path)
    with pytest.raises(production.ProductionConfigError, match="unsupported model_type 'no_such_family'"):
        production.build("alien", tmp_path)
    with pytest.raises(production.ProductionConfigError, match="not a float dtype"):
        production.build("int_dtype", tmp_path)
    assert issubclass(production.ProductionConfigError, ValueError)

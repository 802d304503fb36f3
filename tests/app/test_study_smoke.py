"""experiment=study end to end on a tiny random Gemma3 with tiny settings (seconds), so the study cannot rot.

No quality assertions (random weights): only what must hold for any model — native is its own baseline, a strategy
that changes nothing within the context is exact (a window longer than the context, a TOVA budget above it, a
residual window holding every token), storage codecs shrink the bytes (int4 below int8, a per-layer mix between int4
and native), a lossy window differs, an unknown cache type is reported, not fatal; passkey runs at two lengths; every
RULER task runs and is scored; MQAR scores every query with its distance; kvpress's protocol scores every strategy,
and a compress-after-prefill strategy (snapkv_50, when its type is registered) gets only that, no blockwise numbers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_study_smoke(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "experiment=study",
            "model=gemma3",
            "experiment.smoke=true",
            (
                "experiment.only=[sliding_16,all_local_512,tova_256,int8,int4,int4_residual32,int4_residual512,"
                "int4_first2_dense,snapkv_50,no_such_type]"
            ),
            "+experiment.strategies.sliding_16={attention:{type:sliding,window:16}}",
            "+experiment.strategies.int4_residual512={attention:{storage:int4,residual:512}}",
            "+experiment.strategies.no_such_type={attention:{type:no_such_type}}",
            "+experiment.references.int8={reference:'HF QuantizedCache',agreement:0.98}",
            f"hydra.run.dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RANDOM weights" in result.stdout and "verdicts" in result.stdout
    data = json.loads((out / "study.json").read_text())
    assert data["random_weights"] is True
    rows = {r["name"]: r for r in data["strategies"]}
    assert list(rows)[0] == "native" and set(rows) == {
        "native",
        "sliding_16",
        "all_local_512",
        "tova_256",
        "int8",
        "int4",
        "int4_residual32",
        "int4_residual512",
        "int4_first2_dense",
        "snapkv_50",
        "no_such_type",
        "ablate_attention",  # the control of attention strategies (no recurrent layers: no state controls)
    }
    # the control: attention limited to the current block (smoke: 32 tokens) is a different model past it; a
    # strategy changing attention reads its KL against it
    assert rows["ablate_attention"]["config"] == {"attention": {"type": "chunked", "chunk_size": 32}}
    assert rows["ablate_attention"]["kl"][str(max(data["lengths"]))] > 1e-3
    assert (
        rows["sliding_16"]["control"] == "ablate_attention"
        and "of the KL of dropping its attention" in (rows["sliding_16"]["verdict"])
    )
    assert "unavailable" in rows["no_such_type"]["verdict"] and "no_such_type" in rows["no_such_type"]["error"]
    native, longest = rows["native"], str(max(data["lengths"]))
    assert native["kl"][longest] == 0 and native["bytes_ratio"] == 1 and native["passkey_trials"] == 4
    assert {k: v[1] for k, v in native["passkey_by_length"].items()} == {"256": 2, "320": 2}
    # the passkey runs for experiment.passkey.strategies only (the default's: native, sliding_256, all_local_512,
    # tova_256, int4)
    assert rows["int4"]["passkey_trials"] == 4 and rows["int8"]["passkey_trials"] == 0
    # the global layers made local with a window longer than the context: the same model, token for token
    assert rows["all_local_512"]["kl"][longest] < 1e-6 and rows["all_local_512"]["verdict"].startswith("exact")
    assert all(v == 1.0 for v in rows["all_local_512"]["greedy_agreement"].values())
    # a 16-token window on every layer is a different model past 16 tokens, and holds fewer bytes than native
    assert rows["sliding_16"]["kl"][longest] > 1e-3 and rows["sliding_16"]["bytes_ratio"] < 1
    assert rows["int8"]["bytes_ratio"] < 0.5 and not rows["int8"]["exact_cache"]
    assert rows["int4"]["bytes_ratio"] < rows["int8"]["bytes_ratio"] and not rows["int4"]["exact_cache"]
    assert rows["int4"]["kl"][longest] > rows["int8"]["kl"][longest] > 0
    assert rows["int4"]["bytes"] < rows["int4_first2_dense"]["bytes"] < native["bytes"]  # two layers dense
    assert rows["int4"]["bytes"] < rows["int4_residual32"]["bytes"] < native["bytes"]  # + 32 dense tokens per layer
    # lossy types that lose nothing here: every token inside the residual window, a TOVA budget above the context
    for name in ("int4_residual512", "tova_256"):
        assert rows[name]["kl"][longest] < 1e-6 and all(v == 1.0 for v in rows[name]["greedy_agreement"].values())
    assert all(
        r["bytes_after"] == r["planned_bytes"][longest] and r["bytes"] >= r["bytes_after"]
        for r in rows.values()
        if not r.get("error") and r["protocol"] == "blockwise"
    )
    # every row's bytes split into KV and states (Gemma 3: keys and values only), the Cache's own total too
    for r in (r for r in rows.values() if not r.get("error")):
        assert r["kv_bytes"] == r["bytes"] and r["state_bytes"] == 0 and r["state_saving"] is None
        assert (r["bytes_after_kv"], r["bytes_after_state"]) == (r["bytes_after"], 0)
        assert r["saving"] == 1 - r["bytes_ratio"]
    # kvpress's protocol: every strategy, 16 tokens after each prompt length; native is its own KL reference, and a
    # strategy that is exact within the context stays exact there too
    assert data["continuation"] == 16 and native["continuation_kl"][longest] == 0
    for name in ("all_local_512", "int4_residual512"):
        assert rows[name]["continuation_kl"][longest] < 1e-6
    assert rows["sliding_16"]["continuation_kl"][longest] > 1e-3
    # a compress-after-prefill strategy: no blockwise numbers, kvpress's protocol and its greedy tokens instead
    snapkv = rows["snapkv_50"]
    if not snapkv.get("error"):
        assert snapkv["protocol"] == "prefill" and snapkv["ppl"] == {} and "prefill" in snapkv["verdict"]
        assert set(snapkv["continuation_ppl"]) == set(native["continuation_ppl"]) and snapkv["greedy_agreement"]
    # references are shown when given, empty otherwise
    assert rows["int8"]["reference"] == "HF QuantizedCache" and rows["int8"]["agreement"] == 0.98
    assert native["reference"] is None and native["agreement"] is None
    # RULER (smoke: every task at 1800 bytes, for native and snapkv_50): scored with RULER's metric, 0..100
    assert data["ruler_tasks"] == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
    ]
    assert set(native["ruler"]) == set(data["ruler_tasks"]) and len(native["ruler_trials"]) == 11
    assert all(0 <= t["score"] <= 100 and t["answers"] and t["length"] == 1800 for t in native["ruler_trials"])
    assert rows["int4"].get("ruler_trials") == [] and "RULER: mean score" in result.stdout
    # MQAR (smoke: 4 and 24 pairs, 4 queries each, every strategy): every query scored with its distance; a strategy
    # exact within the context recalls exactly what native recalls, query by query
    assert [t["pairs"] for t in native["mqar_trials"]] == [4, 24] and native["mqar_acc"] is not None
    assert all(len(t["queries"]) == 4 and all(q["distance"] > 0 for q in t["queries"]) for t in native["mqar_trials"])
    for name in ("all_local_512", "int4_residual512"):
        assert [q["correct"] for t in rows[name]["mqar_trials"] for q in t["queries"]] == [
            q["correct"] for t in native["mqar_trials"] for q in t["queries"]
        ]
    assert sum(n for _, n in native["mqar_by_distance"].values()) == 8 and "MQAR" in result.stdout
    assert (out / "study_pareto.png").stat().st_size > 1000
    assert data["wandb_dir"] and Path(data["wandb_dir"]).is_dir()


def _study(tmp_path, model, only, *extra):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / f"out-{model}"
    result = subprocess.run(
        [sys.executable, "run.py", "experiment=study", f"model={model}", "experiment.smoke=true",
         f"experiment.only=[{','.join(only)}]", "experiment.ruler.tasks=[]", "experiment.passkey.lengths=[]",
         "experiment.mqar.pairs=[]", f"hydra.run.dir={out}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["name"]: r for r in json.loads((out / "study.json").read_text())["strategies"]}


def test_a_model_that_ignores_its_ssm_state_gets_no_conclusion_from_a_state_codec(tmp_path):
    """The controls run by default. The shipped trained_hybrid with its SSM readout cut (tests/app/ignored_state.py:
    its Mamba2 states are computed but nothing reads them) gets int8 states that look free, and the study says that
    is no conclusion; its conv states still matter (ablate_state). The shipped model itself (its attention sees 8
    bytes, its states carry the rest) has its int8 states read against the control of dropping them, not flagged.
    A tiny random jamba loses ~3e-5 without its SSM states: above a threshold set below that, the same strategy is
    read against its control."""
    from hybridcache.checkpoints.real import real_checkpoint
    from tests.app.ignored_state import cut_ssm_readout

    cut = cut_ssm_readout(real_checkpoint("trained_hybrid"), tmp_path / "cut")
    rows = _study(tmp_path, "bamba", ["native", "state_int8"], f"model.checkpoint={cut}")
    assert {"ablate_state", "ablate_ssm", "ablate_attention"} <= set(rows)
    assert rows["state_int8"]["control"] == "ablate_ssm" and rows["state_int8"]["control_kl"] < 1e-3
    assert rows["state_int8"]["verdict"].startswith("NO CONCLUSION: the model barely uses its SSM")
    assert rows["ablate_state"]["kl"]["160"] > 1e-3  # the conv states (last bytes) it does use
    rows = _study(tmp_path, "trained_hybrid", ["native", "state_int8"])
    assert rows["state_int8"]["control"] == "ablate_ssm" and rows["state_int8"]["control_kl"] > 1e-3
    assert "NO CONCLUSION" not in rows["state_int8"]["verdict"]
    rows = _study(tmp_path, "jamba", ["native", "state_int8"], "experiment.insensitive_kl=1e-6")
    assert rows["state_int8"]["control"] == "ablate_ssm" and rows["state_int8"]["control_kl"] > 1e-6
    assert (
        "NO CONCLUSION" not in rows["state_int8"]["verdict"]
        and "of the KL of dropping its SSM" in (rows["state_int8"]["verdict"])
    )


def test_every_row_splits_its_bytes_into_kv_and_states_and_saves_on_the_whole_cache(tmp_path):
    """Issue 40 item 6: a study row says what part of the cache a strategy changes and what it saves on the WHOLE
    cache. FalconH1 holds attention and Mamba2 caches side by side in every layer (cache groups): the split of the
    specs' peak adds up to the row's bytes, the split of the Cache's layers after the run to what the Cache reports
    (and, native growing to its end, both splits agree); a state-only strategy leaves KV bytes as they are, a
    KV-only one the states, and each saves less of the whole cache than of the part it changes."""
    rows = _study(tmp_path, "falcon_h1", ["native", "state_int8", "int8"])
    native = rows["native"]
    for r in rows.values():
        assert r["kv_bytes"] + r["state_bytes"] == r["bytes"], r["name"]
        assert r["bytes_after_kv"] + r["bytes_after_state"] == r["bytes_after"], r["name"]
        assert (r["native_kv_bytes"], r["native_state_bytes"]) == (native["kv_bytes"], native["state_bytes"])
        assert r["saving"] == pytest.approx(1 - r["bytes"] / native["bytes"], abs=1e-12)
    assert native["kv_bytes"] > 0 and native["state_bytes"] > 0 and native["saving"] == 0
    assert (native["bytes_after_kv"], native["bytes_after_state"]) == (native["kv_bytes"], native["state_bytes"])
    state = rows["state_int8"]
    assert state["kv_bytes"] == native["kv_bytes"] and state["bytes_after_kv"] == native["bytes_after_kv"]
    assert state["kv_saving"] == 0 and 0 < state["saving"] < state["state_saving"] < 1
    assert "of the whole cache (KV unchanged, its states -" in state["verdict"]
    kv = rows["int8"]
    assert kv["state_bytes"] == native["state_bytes"] and kv["state_saving"] == 0
    assert 0 < kv["saving"] < kv["kv_saving"] < 1 and "states unchanged" in kv["verdict"]

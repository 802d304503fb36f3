"""experiment=study end to end on a tiny random Gemma3 with tiny settings (seconds), so the study cannot rot.

No quality assertions (random weights): only what must hold for any model — native is its own reference, a strategy
that changes nothing within the context is exact (a window longer than the context, a TOVA budget above it, a
residual window holding every token), storage codecs shrink the bytes (int4 below int8, a per-layer mix between int4
and native), a lossy window differs, an unknown cache type is reported, not fatal; passkey runs at two lengths.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_study_smoke(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "run.py", "experiment=study", "model=gemma3", "experiment.smoke=true",
         "experiment.only=[sliding_16,all_local_512,tova_256,int8,int4,kivi,kivi_512,int4_first2_dense,no_such_type]",
         "+experiment.strategies.sliding_16={attention:{type:sliding,window:16}}",
         "+experiment.strategies.kivi_512={attention:{storage:int4,residual:512}}",
         "+experiment.strategies.no_such_type={attention:{type:no_such_type}}", f"hydra.run.dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RANDOM weights" in result.stdout and "verdicts" in result.stdout
    data = json.loads((out / "study.json").read_text())
    assert data["random_weights"] is True
    rows = {r["name"]: r for r in data["strategies"]}
    assert list(rows)[0] == "native" and set(rows) == {"native", "sliding_16", "all_local_512", "tova_256", "int8",
                                                       "int4", "kivi", "kivi_512", "int4_first2_dense", "no_such_type"}
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
    assert rows["int4"]["bytes"] < rows["kivi"]["bytes"] < native["bytes"]  # int4 + 32 dense tokens per layer
    # lossy types that lose nothing here: every token inside the residual window, a TOVA budget above the context
    for name in ("kivi_512", "tova_256"):
        assert rows[name]["kl"][longest] < 1e-6 and all(v == 1.0 for v in rows[name]["greedy_agreement"].values())
    assert all(r["bytes_after"] == r["planned_bytes"][longest] and r["bytes"] >= r["bytes_after"]
               for r in rows.values() if not r.get("error"))
    assert (out / "study_pareto.png").stat().st_size > 1000
    assert data["wandb_dir"] and Path(data["wandb_dir"]).is_dir()

"""The benchmark's smoke version runs end to end (seconds), so the benchmark cannot rot. No timing assertions."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_smoke(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "run.py", "experiment=benchmark", "model=gemma3", "experiment.smoke=true",
                             f"hydra.run.dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "benchmark.json").read_text())
    assert {r["system"] for r in data["throughput"]} == {"ours (eager)", "hf"}
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in data["throughput"])
    # dynamic caches hold exactly the theoretical minimum
    assert all(m["ratio"] == 1.0 for report in data["memory"].values() for m in report)
    strategies = {r["strategy"] for r in data["long_context"]}
    assert strategies == {"sliding(64)", "chunked(64)", "full", "recurrent (mamba2)"}
    assert all(r["peak_rss_mib"] > 0 and r["decode_ms_per_token"] > 0 for r in data["long_context"])
    for png in ("throughput.png", "long_context.png"):
        assert (out / png).stat().st_size > 1000
    assert data["wandb_dir"] and Path(data["wandb_dir"]).is_dir()

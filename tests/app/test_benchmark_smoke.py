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
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "experiment=benchmark",
            "model=gemma3",
            "experiment.smoke=true",
            f"hydra.run.dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "benchmark.json").read_text())
    assert {r["system"] for r in data["throughput"]} == {"ours (eager)", "ours (eager, int8 weights)", "hf"}
    # every rate is positive, or None with the reason stated (a loaded machine's spread); never NaN or negative
    for r in data["throughput"]:
        for phase in ("prefill", "decode"):
            rate, why = r[f"{phase}_tok_s"], r[f"{phase}_unreliable"]
            assert (rate > 0 and why is None) if rate is not None else why, r
            assert r["repeats"] >= 3 and r[f"{phase}_s"] > 0
    for key, value in data["summary"].items():
        if "speedup_vs_hf/" in key and value is None:  # no ratio from an unreliable timing: the reason instead
            assert data["summary"][key.replace("speedup_vs_hf/", "speedup_vs_hf_unreliable/")].startswith("unreliable")
    # the roofline: a measured read bandwidth and, per row, bytes per token = (weights + cache bytes) / batch
    roof = data["summary"]["roofline"]
    assert roof["read_bandwidth_gb_s"] > 0 and roof["weights"] > 0
    packed = next(r for r in data["throughput"] if r["weights_format"] == "int8")
    assert packed["weights_bytes"] < 0.5 * roof["weights"]  # int8 projections: about a quarter of their bytes
    for r in data["throughput"]:
        assert r["weights_bytes"] == (packed["weights_bytes"] if r is packed else roof["weights"])
        assert r["bytes_per_token"] == (r["weights_bytes"] + r["cache_bytes_read"]) / r["batch"]
        assert (
            abs(r["roofline_tok_s"] - roof["read_bandwidth_gb_s"] * 1e9 / r["bytes_per_token"])
            < 1e-6 * r["roofline_tok_s"]
        )
    # speculative decoding and prefix reuse ran and reproduced plain greedy generation exactly
    ops = data["cache_ops"]
    assert ops["speculative"] and all(r["identical"] for r in ops["speculative"])
    assert all(0 <= r["acceptance_rate"] <= 1 for r in ops["speculative"])
    assert ops["prefix_reuse"] and all(r["identical"] and r["hit_rate"] > 0 for r in ops["prefix_reuse"])
    # dynamic caches hold exactly the theoretical minimum
    assert all(m["ratio"] == 1.0 for report in data["memory"].values() for m in report)
    strategies = {r["strategy"] for r in data["long_context"]}
    assert strategies == {"sliding(64)", "chunked(64)", "full", "recurrent (mamba2)"}
    assert all(r["peak_rss_mib"] > 0 and r["decode_ms_per_token"] > 0 for r in data["long_context"])
    for png in ("throughput.png", "long_context.png"):
        assert (out / png).stat().st_size > 1000
    assert data["wandb_dir"] and Path(data["wandb_dir"]).is_dir()

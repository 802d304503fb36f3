"""A tampered kernel directory (tests/ops/kernel_tamper.py, in a subprocess): a planted library never runs (its
constructor would write a marker file), a truncated one never kills the process, one without the expected symbols
falls back, a changed C source file (any of them) is never served by the library of the unchanged ones; each case
generates the same tokens as the torch path, with one warning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hybridcache.accel.native.kernels as ck
from hybridcache.accel.native.build import read_sources
from hybridcache.checkpoints.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
REBUILT = {
    "planted, no manifest": "it has no manifest",
    "planted, genuine manifest (swapped library)": "truncated or resized",
    "truncated, genuine manifest": "truncated or resized",
    "truncated, no manifest": "it has no manifest",
    "library without the expected symbols, no manifest": "it has no manifest",
}
REFUSED = {
    "planted + forged manifest, directory writable by others": "writable by group and others (mode 777)",
    "planted + forged manifest, library writable by group": "writable by group (mode 775)",
    "planted + forged manifest, library is a symbolic link": "cannot be opened safely",
    "planted + forged manifest, directory owned by another user": "owned by uid 65534",
    "genuine build lacking a symbol": "lacks hc_selective_scan",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if ck._library() is None:
        pytest.skip(f"no CPU kernel here: {ck.kernel_status()}")
    models = [str(tiny_checkpoint(family)) for family in ("gemma3", "mamba")]  # attention + MLP; the Mamba1 scan
    work = tmp_path_factory.mktemp("tamper")
    args = [sys.executable, "-m", "tests.ops.kernel_tamper", "--workdir", str(work)]
    for m in models:
        args += ["--model", m]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_no_foreign_code_ran(result):
    assert result["marker_exists"] is False
    assert result["pristine"].startswith("C kernels") and result["pristine_equal_torch_path"]


@pytest.mark.parametrize("case, why", REBUILT.items())
def test_unverified_libraries_are_rebuilt(result, case, why):
    got = result["cases"][case]
    assert got["path"] == "C" and got["kernel_ran"] and got["tokens_equal_torch_path"], got
    assert len(got["warnings"]) == 1 and why in got["warnings"][0] and "rebuilding it" in got["warnings"][0]


@pytest.mark.parametrize("case, why", REFUSED.items())
def test_unsafe_directories_and_files_are_refused(result, case, why):
    if case not in result["cases"]:
        pytest.skip("needs root (to give a directory to another user)")
    got = result["cases"][case]
    assert got["path"] == "torch" and not got["kernel_ran"] and got["tokens_equal_torch_path"], got
    assert got["status"].startswith("torch path: ") and why in got["status"]
    assert len(got["warnings"]) == 1 and why in got["warnings"][0]


@pytest.mark.parametrize("file", [name for name, _ in read_sources(ck.SOURCE)])
def test_each_changed_source_file_is_compiled_not_served_by_the_old_build(result, file):
    """Next to the pristine build, the sources with `file` changed (an #error first): a build key that missed this
    file would find and load that build (path C); it is compiled instead, and fails on this file's line."""
    got = result["cases"][f"tampered source {file}"]
    assert got["path"] == "torch" and not got["kernel_ran"] and got["tokens_equal_torch_path"], got
    assert got["status"].startswith("torch path: the C kernels did not build (") and f"{file}:1:" in got["status"]
    assert f"#error tampered {file}" in got["status"] and len(got["warnings"]) == 1, got

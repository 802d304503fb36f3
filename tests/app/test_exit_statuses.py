"""Exit statuses of `python run.py` when the operating system refuses what a run needs (issue "Reliability, second
pass", item 6): status 4 and one line `error: ...` naming the path and the OS's reason, no traceback, no partial file.

Before: each of these exited 1 (the README's "an exact plan failed its oracle") with Hydra's 5-51 line traceback,
and a record cut short by a full disk stayed on disk. The OS is made to refuse for real: an output directory under
a file (ENOTDIR), under /proc (ENOENT) or /sys (EPERM: how a permission refusal is made as root, who bypasses mode
bits, so chmod 0o500 would test nothing), /dev/full (ENOSPC), a file size limit (RLIMIT_FSIZE: EFBIG, a full disk
without a mount), a 5,000-character checkpoint path (ENAMETOOLONG).
"""

import json
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.test_app_runs import SHORT, app, no_model_load  # noqa: F401 - the in-process run.py fixture

ROOT = Path(__file__).resolve().parents[2]
ENV_FAILURE = 4


def run_py(tmp_path, *args, umask=None, fsize=None, home=None):
    """`python run.py ARGS` in a subprocess -> (exit status, stderr lines); optionally under a umask and a file
    size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so a write past it fails with EFBIG, as on a full disk)."""

    def limits():
        if umask is not None:
            os.umask(umask)
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "HYBRIDCACHE_HOME": str(home or tmp_path / "home"),
        "HYBRIDCACHE_DISABLE_KERNELS": "1",  # no kernel build under the file size limit
    }
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run(
        [sys.executable, "run.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limits,
    )
    return result.returncode, result.stderr.splitlines()


def assert_one_line(code, err, *expected, status=ENV_FAILURE):
    assert code == status, (code, err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    for text in expected:
        assert text in err[0], err[0]


# -- the output directory: Hydra creates it before the run (fast: nothing is imported past Hydra) ---------------------
def test_an_output_directory_under_a_file(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    code, err = run_py(tmp_path, "model=jamba", f"hydra.run.dir={tmp_path / 'file' / 'out'}")
    assert_one_line(code, err, str(tmp_path / "file" / "out"), "Not a directory [ENOTDIR]")
    assert (tmp_path / "file").read_text() == "not a directory"


def test_a_sweep_directory_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    code, err = run_py(tmp_path, "-m", "model=jamba,mamba2", f"hydra.sweep.dir={tmp_path / 'file' / 'sweep'}")
    assert_one_line(code, err, "Not a directory [ENOTDIR]")


@pytest.mark.parametrize(
    "where,reason",
    [
        ("/proc/hybridcache-out", "[ENOENT]"),  # procfs creates no directories
        ("/sys/hybridcache-out", "[EPERM]"),  # sysfs refuses even root: the permission variant
    ],
)
def test_an_output_directory_the_kernel_refuses(tmp_path, where, reason):
    if os.path.exists(where):
        pytest.skip(f"{where} exists on this machine")
    code, err = run_py(tmp_path, "model=jamba", f"hydra.run.dir={where}")
    assert_one_line(code, err, where, reason)


# -- inside the run -----------------------------------------------------------------------------------------------
def test_a_record_on_a_full_device(app):  # noqa: F811
    code, results, out, err = app("model=mamba2", *SHORT, "+record=/dev/full")
    assert code == ENV_FAILURE and err == "error: record: /dev/full: No space left on device [ENOSPC]\n", err
    assert "Traceback" not in out + err
    assert results["status"] == "error" and results["exit_code"] == ENV_FAILURE and "ENOSPC" in results["error"]
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # written in place, never replaced by a file


def test_a_full_disk_leaves_no_partial_record_and_the_umask_is_kept(tmp_path, tmp_path_factory, monkeypatch):
    """A record larger than the file size limit (8 KiB: each results.json before it fits): exit 4, one line, no
    record and no temporary file left (before: an 8,192-byte partial record); results.json says why, with the mode
    the umask gives (0o640 under umask 027; mkstemp's 0o600 before)."""
    from hybridcache.checkpoints.tiny import tiny_checkpoint

    home = tmp_path_factory.getbasetemp() / "hybridcache-home"
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(home))
    tiny_checkpoint("mamba2")  # built before the limit (its weights are larger than 8 KiB)
    out, record = tmp_path / "out", tmp_path / "rec" / "generations.jsonl"
    code, err = run_py(
        tmp_path,
        "model=mamba2",
        SHORT[0],
        "max_new_tokens=8",
        "top_k=16",  # a record of about 20 KB
        "reference=none",
        "logger.mode=disabled",
        f"+record={record}",
        f"hydra.run.dir={out}",
        umask=0o027,
        fsize=8192,
        home=home,
    )
    assert_one_line(code, err, f"record: {record}", "File too large [EFBIG]")
    assert list(record.parent.iterdir()) == [], "a partial record or a temporary file was left"
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "error" and results["exit_code"] == ENV_FAILURE
    assert stat.S_IMODE((out / "results.json").stat().st_mode) == 0o640
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_checkpoint_path_too_long_for_the_os(app, monkeypatch):  # noqa: F811
    no_model_load(monkeypatch)
    long = "/" + "c" * 5000
    code, results, out, err = app("model=jamba", f"model.checkpoint={long}")
    assert code == ENV_FAILURE and "File name too long [ENAMETOOLONG]" in err, err
    assert err.startswith("error: model.checkpoint: /ccc") and len(err.strip().splitlines()) == 1
    assert "(5001 characters)" in err and len(err) < 400, "the path is shortened, not printed whole"
    assert "Traceback" not in out + err and results["exit_code"] == ENV_FAILURE


def test_a_record_path_is_checked_before_the_model_loads(app, monkeypatch, tmp_path):  # noqa: F811
    no_model_load(monkeypatch)
    code, _, _, err = app("model=jamba", f"+record={tmp_path}")  # a directory: the user's mistake
    assert code == 2 and err.startswith(f"error: record={tmp_path} is a directory") and err.count("\n") == 1, err
    (tmp_path / "file").write_text("x")
    code, _, _, err = app("model=jamba", f"+record={tmp_path / 'file' / 'r.jsonl'}")  # under a file: the OS refuses
    assert code == ENV_FAILURE and err == f"error: record: {tmp_path / 'file'}: Not a directory [ENOTDIR]\n", err


def test_other_errors_are_still_reported_by_hydra(capsys, monkeypatch):
    """A crash (not an OS refusal) keeps Hydra's own report and status 1."""
    from experiments import run_cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def crash():
        raise RuntimeError("a bug")

    with pytest.raises(SystemExit) as stop:
        run_cli(crash)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("RuntimeError: a bug") and "error: " not in err
    assert "HYDRA_FULL_ERROR" not in os.environ  # put back as it was


# -- reference answers (item 7): a live reference answering garbage is status 3; a malformed recording, status 2 -----
def test_a_live_reference_answering_garbage_is_status_3(app, tmp_path):  # noqa: F811
    """reference=vllm whose worker answers a truncated JSON (the interpreter is a script that writes one): one line,
    status 3 (before: a JSONDecodeError traceback, status 1)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf \'{"results": [{"prompt": [1, 2], "tok\' > "$3"\n')  # argv: worker req ans
    fake.chmod(0o755)
    code, results, out, err = app(
        "model=mamba2", *SHORT[:-1], "reference=vllm", f"reference.python={fake}", "reference.platform=cpu"
    )
    assert code == 3 and err.startswith("error: the vllm reference failed: the vLLM worker's answer is not JSON (")
    assert err.count("\n") == 1 and "Traceback" not in out + err, err
    assert results["status"] == "error" and results["exit_code"] == 3


def test_a_malformed_recording_is_status_2_before_the_model_loads(app, monkeypatch, tmp_path):  # noqa: F811
    from hybridcache.reference import Generation

    no_model_load(monkeypatch)
    line = Generation([1, 2], [3], [-0.5], [{3: -0.5}]).to_json()
    path = tmp_path / "refs.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "tokens": ["3"]}) + "\n")
    code, _, out, err = app("model=jamba", "reference=file", f"reference.path={path}")
    assert code == 2 and err.startswith(f"error: {path}:2: not a recorded generation (tokens[0] must be a token id")
    assert err.count("\n") == 1 and "Traceback" not in out + err, err

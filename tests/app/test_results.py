"""The one results writer (experiments/core/results.py): atomic, schema-versioned, used by every experiment."""

import ast
import json
import os
from pathlib import Path

import pytest

from experiments.core import results as results_module
from experiments.core.results import SCHEMA_VERSION, read_results, write_results
from tests.app.test_app_runs import SHORT, app  # noqa: F401 - the in-process run.py fixture

ROOT = Path(__file__).resolve().parents[2]


def test_written_with_schema_version_first(tmp_path):
    path = write_results(tmp_path / "new", {"status": "ok", "value": 1.5, "schema_version": 99})
    assert path == tmp_path / "new" / "results.json"
    text = path.read_text()
    data = json.loads(text)
    assert data == {"schema_version": SCHEMA_VERSION, "status": "ok", "value": 1.5}  # the caller cannot override it
    assert next(iter(data)) == "schema_version"
    assert isinstance(SCHEMA_VERSION, int) and SCHEMA_VERSION >= 1


def test_other_names_and_unserialisable_values(tmp_path):
    path = write_results(tmp_path, {"path": tmp_path, "n": 3}, name="study.json")
    assert json.loads(path.read_text()) == {"schema_version": SCHEMA_VERSION, "path": str(tmp_path), "n": 3}


@pytest.mark.parametrize("broken", ["dumps", "replace", "write"])
def test_a_failure_mid_write_leaves_the_old_file_intact(tmp_path, monkeypatch, broken):
    path = write_results(tmp_path, {"status": "running", "step": 1})
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    if broken == "dumps":
        monkeypatch.setattr(results_module.json, "dumps", boom)
    elif broken == "replace":
        monkeypatch.setattr(os, "replace", boom)
    else:  # the temporary file's write itself fails after part of the text went out
        real_fdopen = os.fdopen

        class Half:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text[: len(text) // 2])
                raise OSError("disk full")

        monkeypatch.setattr(os, "fdopen", lambda fd, mode: Half(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="disk full"):
        write_results(tmp_path, {"status": "ok", "step": 2})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary file left behind


def test_files_from_before_versioning_read_as_version_zero(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"status": "ok"}))
    assert read_results(tmp_path / "results.json") == {"status": "ok", "schema_version": 0}


def test_no_experiment_writes_a_results_file_by_hand():
    """Every json.dumps(...) that goes into a file under experiments/ goes through write_results: a write_text or
    write whose argument is a json.dumps call is a results file written around the shared writer."""
    offenders = []
    allowed = {  # files that are not an experiment's results
        "experiments/core/results.py",
        "experiments/train/main.py",  # its checkpoint history (in the run directory, next to the weights)
        "experiments/study/budget_planner.py",  # a standalone script's lists (its own CLI)
        "experiments/core/report.py",  # the sweep summary: a list over the runs' results.json
    }
    for file in sorted((ROOT / "experiments").glob("*.py")):
        rel = str(file.relative_to(ROOT))
        for node in ast.walk(ast.parse(file.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("write_text", "write")
                and node.args
                and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Attribute)
                and node.args[0].func.attr == "dumps"
                and rel not in allowed
            ):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def test_correctness_results_carry_the_schema_version(app):  # noqa: F811
    code, data, _, _ = app(*SHORT)
    assert code == 0 and data["status"] == "ok"
    assert data["schema_version"] == SCHEMA_VERSION


def test_an_error_result_carries_the_schema_version(app):  # noqa: F811
    code, data, _, err = app(*SHORT[:-1], "max_new_tokens=0", "reference=none")
    assert code == 2 and "max_new_tokens must be a positive integer" in err
    assert data["status"] == "error" and data["schema_version"] == SCHEMA_VERSION


def test_every_experiment_writes_through_the_shared_writer():
    """Each experiment run.py can start (experiments.EXPERIMENTS) writes its results with RunContext.write or
    write_results, so each one's results file carries schema_version (the smoke runs check the values)."""
    from experiments import EXPERIMENTS

    for name, module in EXPERIMENTS.items():
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        tree = ast.parse(source)
        calls = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }
        assert "RunContext" in source and calls & {"write", "write_results"}, name


# -- modes: a plain open()'s, not mkstemp's 0600 (issue "Reliability, second pass", item 9) -------------------------
UMASK_SCRIPT = r"""
import json, os, stat, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from experiments.core.results import save_figure, write_results, write_text
from hybridcache.util.atomic_files import current_umask
from hybridcache.reference import Generation, write_jsonl

out = Path(sys.argv[1])
(out / "kept.json").write_text("{}")
os.chmod(out / "kept.json", 0o604)  # an existing file keeps its mode, as open(path, "w") keeps it
os.symlink("target.json", out / "link.json")
write_results(out, {"status": "ok"})
write_results(out, {"status": "ok"}, name="kept.json")
write_results(out, {"status": "ok"}, name="link.json")
write_text(out / "console.log", "text")
write_jsonl(out / "rec" / "r.jsonl", [Generation([1], [2], [-0.5], [{2: -0.5}])])
fig = plt.figure()
save_figure(fig, out / "figure.png")
write_results(Path("/dev"), {"status": "ok"}, name="null")  # a device is written in place
files = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in files}
print(json.dumps({"umask": current_umask(), "modes": modes, "link": os.readlink(out / "link.json")}))
"""


@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_outputs_get_the_mode_a_plain_open_gives_under_the_umask(tmp_path, umask):
    import stat
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", UMASK_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(umask),
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["umask"] == umask  # read from /proc/self/status, the process's own
    new = 0o666 & ~umask
    assert seen["modes"] == {
        "results.json": new,
        "kept.json": 0o604,
        "target.json": new,  # written through the link, which stays a link
        "console.log": new,
        "rec/r.jsonl": new,
        "figure.png": new,
    }
    assert seen["link"] == "target.json"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_stream_is_written_in_place_not_replaced(tmp_path):
    """+record=/dev/stdout: /dev/stdout is a link to /proc/self/fd/1 (a pipe here, a redirected log elsewhere): written
    through as open() would, never a temporary file beside the link's target (6045e46 failed with ENOENT there)."""
    import subprocess
    import sys

    code = (
        "from hybridcache.util.atomic_files import write_output\n"
        "print('console', flush=True)\n"
        "write_output('/dev/stdout', 'record\\n')\n"
        "print('after', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "console\nrecord\nafter\n"
    log = tmp_path / "log.txt"
    with log.open("w") as out:  # a redirected log: a regular file reached through /proc, truncated like open() does
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=out, timeout=300, check=True)
    assert log.read_bytes().endswith(b"after\n") and b"record\n" in log.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt"]  # not replaced: no new file, no temp file

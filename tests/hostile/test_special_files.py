"""Special files under a checkpoint file's name (issue "Reliability, second pass", item 4): a FIFO, a directory, a
socket, or a link to one, named config.json, model.safetensors, model.safetensors.index.json or a shard. Each load
is refused by a named error that names the file, and never blocks. A FIFO opened for reading waits for a writer
forever (safetensors' open even holds the GIL while it waits, so a thread cannot time out), so the loads run in a
child process, and one still running after its time limit is unblocked from here (a writer opens each of its
FIFOs) and reported as blocked instead of hanging the suite."""

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hybridcache as hc
from hybridcache.models.core.checkpoint_files import CheckpointError, open_regular
from tests.hostile.kit import COUNTS, files_unchanged, report
from tests.models.test_loading_hostile import shard_in_two

LIMIT_S = 30.0
ROOT = Path(__file__).resolve().parents[2]

# The child: one from_pretrained per directory read from stdin, one JSON line each (kit.outcome's verdict: None for
# a named error with a message), flushed at once so that the parent sees which load is still running.
CHILD = """
import json, sys
import hybridcache as hc
from tests.hostile.kit import outcome
for i, d in enumerate(json.loads(sys.stdin.read())):
    message = []
    def call(d=d):
        try:
            hc.from_pretrained(d)
        except Exception as e:
            message.append(str(e))
            raise
    print(json.dumps({"i": i, "why": outcome(call), "message": message[0] if message else ""}), flush=True)
"""


def unblock(fifos) -> None:
    """Open each FIFO for writing (non-blocking: it only succeeds while a reader waits) and close it: the reader's
    open returns and it reads end-of-file."""
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def load_each(directories, fifos) -> list[dict]:
    """from_pretrained on each directory in a child process: its JSON verdicts, `blocked` set on those that ran
    longer than LIMIT_S (then unblocked through `fifos[i]`)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    child.stdin.write(json.dumps([str(d) for d in directories]))
    child.stdin.close()
    results, blocked, started = [], set(), time.monotonic()
    try:
        while len(results) < len(directories):
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if ready:
                line = child.stdout.readline()
                if not line:
                    raise AssertionError(f"the child process ended after {len(results)} loads")
                results.append({**json.loads(line), "blocked": len(results) in blocked})
                started = time.monotonic()
            elif time.monotonic() - started > LIMIT_S + 60 * (not results):  # (the child's imports come first)
                blocked.add(len(results))
                unblock(fifos[len(results)])
    finally:
        child.kill()
        child.wait()
    return results


def without_blocking(call, fifos):
    """call() in a thread (for calls that release the GIL while they wait): its exception re-raised, or
    AssertionError when it is still running after LIMIT_S (then unblocked through `fifos`)."""
    done = {}

    def run():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    blocked = thread.is_alive()
    while thread.is_alive():
        unblock(fifos)
        thread.join(0.5)
    if blocked:
        raise AssertionError(f"the call blocked for more than {LIMIT_S:.0f} s")
    if "error" in done:
        raise done["error"]


def special(directory, name, kind) -> list:
    """Replace `directory / name` by a special file of `kind`; returns the FIFOs made (to unblock)."""
    path = directory / name
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return [path]
    if kind == "directory":
        path.mkdir()
        (path / "inside.json").write_text("{}")
    elif kind == "socket":  # bound by a relative name: AF_UNIX paths are limited to about 108 bytes
        here = os.getcwd()
        os.chdir(directory)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(name)
        finally:
            os.chdir(here)
    elif kind == "link to a fifo inside":
        os.mkfifo(directory / "pipe")
        os.symlink("pipe", path)
        return [directory / "pipe"]
    elif kind == "link to /dev/null":  # outside the directory: the link policy refuses it before its kind matters
        os.symlink("/dev/null", path)
    return []


NAMES = {
    "single": ["config.json", "model.safetensors"],
    "sharded": ["config.json", "model.safetensors.index.json", "b.safetensors"],
}
KINDS = ["fifo", "directory", "socket", "link to a fifo inside", "link to /dev/null"]


@pytest.fixture(scope="module")
def original(checkpoints, tmp_path_factory):
    target = tmp_path_factory.mktemp("special_ckpt") / "gemma3"
    shutil.copytree(checkpoints("gemma3"), target)
    return target


def test_special_files_are_refused_by_name_without_blocking(original, tmp_path):
    cases, directories, fifos = [], [], []
    for layout, names in NAMES.items():
        for name in names:
            for kind in KINDS:
                d = tmp_path / f"{layout}-{name}-{kind}".replace(" ", "_").replace("/", "_")
                shutil.copytree(original, d)
                if layout == "sharded":
                    shard_in_two(d)
                fifos.append(special(d, name, kind))
                directories.append(d)
                cases.append((f"{layout} checkpoint, {name} is a {kind}", name))
    unchanged = files_unchanged(tmp_path, original)
    problems = []
    for (description, name), result in zip(cases, load_each(directories, fifos), strict=True):
        COUNTS["special files"] += 1
        why = "blocked until a writer opened its FIFO" if result["blocked"] else result["why"]
        if not why and name not in result["message"]:
            why = f"the error does not name {name}: {result['message']}"
        if why:
            problems.append(f"{description}: {why}")
    problems += [p for p in [unchanged()] if p]
    assert not problems, report(problems, len(cases))
    assert unchanged.digests()


def test_a_fifo_swapped_in_after_the_name_check_is_refused_on_the_descriptor(tmp_path, monkeypatch):
    """The name is checked, then a FIFO takes its place before the open: the open does not wait for a writer
    (O_NONBLOCK) and the descriptor's own check refuses it."""
    import hybridcache.models.core.checkpoint_files as files

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "check_regular", lambda path, what: path)  # the swap happens right after the check
    with pytest.raises(CheckpointError, match=r"config.json is a FIFO \(named pipe\), not a regular file"):
        without_blocking(lambda: open_regular(fifo, str(fifo)), [fifo])


def test_regular_files_and_links_inside_still_load(original, tmp_path):
    d = tmp_path / "linked"
    shutil.copytree(original, d)
    os.replace(d / "config.json", d / "real_config.json")
    os.symlink("real_config.json", d / "config.json")
    model = hc.from_pretrained(d)
    assert model.family == "gemma3"


def test_a_config_json_of_a_terabyte_is_refused_after_64_mib(original, tmp_path):
    """A sparse 1 TiB config.json (no disk used): read whole, it would ask for a terabyte of memory."""
    d = tmp_path / "huge"
    shutil.copytree(original, d)
    with open(d / "config.json", "r+b") as f:
        f.truncate(1 << 40)
    with pytest.raises(CheckpointError, match=r"config.json is larger than 64 MiB"):
        hc.from_pretrained(d)


def test_the_vllm_runner_reads_config_json_only_as_a_regular_file(tmp_path):
    """The vLLM reference reads the checkpoint's config.json in our process (its family's engine arguments)."""
    from hybridcache.reference.vllm_runner import VLLMRunner

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"config.json is a FIFO \(named pipe\), not a regular file"):
        without_blocking(lambda: VLLMRunner(sys.executable, str(tmp_path), platform="cpu"), [tmp_path / "config.json"])


def test_the_apps_tokenizer_and_native_layer_reads_refuse_special_files_and_bombs(original, tmp_path):
    """The app reads a checkpoint before loading it: its tokenizer files (transformers opens them blindly) and its
    native cache layers (the cache plan, built from config.json alone). A FIFO named tokenizer.json is a named
    error, not a hang; a layer-count bomb in config.json is a ConfigError before anything large is built."""
    from experiments.core.common import load_tokenizer, native_layers_of
    from hybridcache.models import ConfigError

    directory = tmp_path / "ckpt"
    shutil.copytree(original, directory)
    os.mkfifo(directory / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer.json is a FIFO"):
        without_blocking(lambda: load_tokenizer(str(directory)), [directory / "tokenizer.json"])
    os.unlink(directory / "tokenizer.json")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        without_blocking(lambda: native_layers_of(directory), [])

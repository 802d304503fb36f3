"""Building and loading the C kernels (hybridcache/accel/native/build.py): manifest, reuse, one notice per fallback, no
compiler, a machine other than x86-64, a compiler without OpenMP, concurrent builders. Tampered kernel directories:
test_kernel_tamper.py (in a subprocess)."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import hybridcache.accel.native.kernels as ck
import hybridcache.accel.native.library as cpu_library
from hybridcache.accel.native import build as _native
from hybridcache.ops.attention import masked_attention

FAST = ["-O0", "-march=native", "-shared", "-fPIC", "-std=gnu11"]  # every test here builds: compile quickly
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader that has loaded nothing, building into tmp_path/kernels; the session's library is back afterwards."""
    monkeypatch.setattr(cpu_library, "_state", {})
    monkeypatch.setattr(_native, "BASE_FLAGS", list(FAST))
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HYBRIDCACHE_DISABLE_KERNELS", raising=False)
    return tmp_path / "kernels"


def status_and_notices():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = ck.kernel_status()
    return status, [str(w.message) for w in caught if issubclass(w.category, _native.KernelNotice)]


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_DISABLE_KERNELS", "1")
    status, notices = status_and_notices()
    assert status == "torch path: kernels off (HYBRIDCACHE_DISABLE_KERNELS is set)" and notices == []
    with torch.no_grad():
        assert ck.decode_linear(torch.randn(1, 8), torch.randn(4, 8)) is None
    assert not fresh.exists()  # nothing built, nothing looked at


def test_built_once_with_a_manifest_then_verified_and_reused(fresh):
    status, notices = status_and_notices()
    assert status.startswith("C kernels: ") and "sha256-verified" in status and notices == []
    (so,) = fresh.glob("cpu_decode-*.so")
    record = json.loads(so.with_suffix(".json").read_text())
    assert record["file"] == so.name and record["size"] == so.stat().st_size and record["openmp"] is True
    assert so.name.startswith("cpu_decode-" + record["build_key"][:16])
    assert record["flags"] == [*FAST, "-fopenmp"] and len(record["sha256"]) == 64
    sources = sorted(p for p in ck.SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))
    assert record["sources"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources}
    for path in (fresh, so, so.with_suffix(".json")):
        assert not path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), path
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert not list(fresh.glob(".build-*"))  # the temporary build directory is gone
    mtime = so.stat().st_mtime_ns
    ck._reset()
    status2, notices2 = status_and_notices()  # as a second process finds it: verified, not rebuilt
    assert status2 == status and notices2 == [] and so.stat().st_mtime_ns == mtime


def test_another_digest_is_another_build(fresh, monkeypatch):
    """The digest covers the flags (and source, compiler, CPU): a change builds a new library beside the old."""
    ck.kernel_status()
    ck._reset()
    monkeypatch.setattr(_native, "BASE_FLAGS", [*FAST, "-DHC_SOMETHING_ELSE"])
    assert ck.kernel_status().startswith("C kernels")
    assert len(list(fresh.glob("cpu_decode-*.so"))) == 2 == len(list(fresh.glob("cpu_decode-*.json")))


def test_the_build_key_covers_every_source_file(tmp_path):
    """Each C file and header beside the entry is read, and a change to any one (a byte, its name, one more file,
    one fewer) is another build key; the entry's name counts too."""
    src = tmp_path / "csrc"
    shutil.copytree(ck.SOURCE.parent, src)
    (src / "notes.txt").write_text("not a source")  # neither .c nor .h: not read
    entry = src / ck.SOURCE.name

    def key(entry=entry):
        return _native._Build("cpu_decode", entry.name, _native.read_sources(entry), ("cc",), "cc 1", "cpu", ()).key

    names = [name for name, _ in _native.read_sources(entry)]
    assert names == sorted(p.name for p in ck.SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))
    assert len(names) > 2 and any(n.endswith(".h") for n in names) and ck.SOURCE.name in names
    base, keys = key(), set()
    for name in names:
        data = (src / name).read_bytes()
        (src / name).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the last byte
        keys.add(key())
        (src / name).write_bytes(data)
        (src / name).rename(src / ("renamed_" + name))
        if name != entry.name:
            keys.add(key())
        (src / ("renamed_" + name)).rename(src / name)
    assert key() == base and base not in keys and len(keys) == 2 * len(names) - 1
    (src / "extra.h").write_text("/* one more header */\n")
    assert key() not in keys | {base}
    (src / "extra.h").unlink()
    (src / "notes.txt").write_text("changed")
    assert key() == base
    (src / "copy.c").write_bytes(entry.read_bytes())
    assert key(src / "copy.c") != key()
    with pytest.raises(FileNotFoundError):
        _native.read_sources(src / "missing.c")


def test_a_failed_build_warns_once_and_falls_back(fresh, monkeypatch):
    monkeypatch.setattr(_native, "BASE_FLAGS", [*FAST, "-include", "/nonexistent/header.h"])
    status, notices = status_and_notices()
    assert status.startswith("torch path: the C kernels did not build (") and "header.h" in status
    assert len(notices) == 1 and "did not build" in notices[0]
    assert not list(fresh.glob("cpu_decode-*")) and not list(fresh.glob(".build-*"))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with torch.no_grad():
        assert ck.decode_linear(x, w) is None


def test_no_compiler_is_one_notice_and_the_torch_path(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    status, notices = status_and_notices()
    assert status == "torch path: no C compiler found ($CC='/nonexistent/cc' not found)"
    assert notices == [f"hybridcache: {status.removeprefix('torch path: ')}; using the torch path"]
    assert ck.kernel_status() == status  # asked again: no second notice, no second look
    with torch.no_grad():
        assert ck.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le"])
def test_other_machines_get_the_torch_path_with_one_notice(fresh, monkeypatch, machine):
    monkeypatch.setattr(_native.platform, "machine", lambda: machine)
    status, notices = status_and_notices()
    assert status == f"torch path: no C kernels for {machine} (x86-64 AVX2 / AVX-512 code only)"
    assert len(notices) == 1 and not fresh.exists()


def test_a_compiler_without_openmp_builds_one_thread_kernels_and_says_so(fresh, monkeypatch, tmp_path):
    """What Apple clang does with -fopenmp, played by a wrapper around this machine's compiler."""
    cc = tmp_path / "clang-without-openmp"
    cc.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        for a in "$@"; do
          if [ "$a" = -fopenmp ]; then echo "clang: error: unsupported option '-fopenmp'" >&2; exit 1; fi
        done
        exec cc "$@"
    """)
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    status, notices = status_and_notices()
    assert status.startswith("C kernels: ") and "one thread (no OpenMP)" in status, status
    assert "built without OpenMP" in status
    assert len(notices) == 1 and "does not take -fopenmp" in notices[0]
    lib = ck._library()
    assert lib.hc_openmp() == 0 and lib.hc_threads() == 1
    (record,) = [json.loads(p.read_text()) for p in fresh.glob("*.json")]
    assert record["openmp"] is False and "-fopenmp" not in record["flags"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 1, 64, generator=g),
        torch.randn(1, 1, 900, 64, generator=g),
        torch.randn(1, 1, 900, 64, generator=g),
    )
    mask = torch.rand(1, 1, 900, generator=g) < 0.5
    with torch.no_grad():
        got = ck.decode_attention(q, k, v, mask, 0.125, None)
        y = ck.decode_linear(torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g))
    want = masked_attention(q.double(), k.double(), v.double(), mask, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert y is not None
    ck._reset()  # the next process: finds the one-thread build (the OpenMP one does not exist), says so again
    status2, notices2 = status_and_notices()
    assert status2 == status and len(notices2) == 1 and len(list(fresh.glob("*.so"))) == 1


def test_concurrent_first_loads_build_once(fresh, tmp_path):
    """Two processes that find no library: one builds under the lock, the other waits and loads that build."""
    script = textwrap.dedent(f"""
        import hybridcache.accel.native.build as n, hybridcache.accel.native.kernels as ck
        n.BASE_FLAGS[:] = {FAST!r}
        print(ck.kernel_status())
    """)
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [out.strip() for out, _ in outs]
    assert lines[0] == lines[1] and lines[0].startswith("C kernels") and "rebuilt" not in lines[0]
    assert len(list(fresh.glob("cpu_decode-*.so"))) == 1 and not list(fresh.glob(".build-*"))
    assert not any("KernelNotice" in err for _, err in outs)


def test_an_io_error_in_the_kernel_directory_falls_back(fresh, monkeypatch):
    def unreadable(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_native, "_verify", unreadable)
    status, notices = status_and_notices()
    assert status.startswith("torch path: the kernel directory is unusable") and len(notices) == 1

"""Where `Cache.save` writes, and for whom (issue 39, items 4, 5, 8, 9): it never replaces anything but a regular
file (or a symlink, which it replaces without following), any legal file name works, a saver killed mid-write leaves
a temp file the next save in that directory removes, new files get the umask's mode, and a cache filled by one
model is not saved as another's."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, CacheError
from hybridcache.cache.io.persistence import CacheFileError
from hybridcache.util import atomic_files
from hybridcache.util.atomic_files import remove_stale_temps
from tests.models.conftest import prompts
from tests.models.saved_cache import save_jamba_cache


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    return save_jamba_cache(models, tmp_path_factory.mktemp("saved"))


def _listing(directory):
    return sorted((p.name, stat.S_IFMT(os.lstat(p).st_mode)) for p in directory.iterdir())


# -- item 4: special files are never replaced ---------------------------------------------------------------------
def _special(tmp_path, kind):
    path = tmp_path / f"{kind}.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":  # /dev/null's numbers; mknod needs root (CI and this sandbox run as root)
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    return path


@pytest.mark.parametrize("kind", ["fifo", "chardev", "directory", "socket"])
def test_save_refuses_to_replace_a_special_file(saved, tmp_path, kind):
    model, cache, _ = saved
    path = _special(tmp_path, kind)
    before = _listing(tmp_path)
    with pytest.raises(CacheError, match="not a regular file; refusing to replace it"):
        cache.save(path, model=model)
    assert _listing(tmp_path) == before  # the node is still there, as it was, and no temp file


def test_save_into_a_missing_directory_is_named(saved, tmp_path):
    model, cache, _ = saved
    with pytest.raises(CacheError, match="does not exist"):
        cache.save(tmp_path / "nowhere" / "c.safetensors", model=model)
    assert list(tmp_path.iterdir()) == []


# -- item 8: file names of any legal length, temp files of killed savers ------------------------------------------
def test_a_250_byte_file_name_saves_and_loads(saved, tmp_path):
    model, cache, _ = saved
    path = tmp_path / ("c" * 238 + ".safetensors")  # 250 bytes: legal (NAME_MAX 255), but too long for name + suffix
    assert len(path.name) == 250
    cache.save(path, model=model)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert torch.equal(Cache.load(path, model).snapshot().seen, cache.snapshot().seen)


_KILLED_SAVER = textwrap.dedent(
    """
    import os, sys, time, torch
    import hybridcache as hc
    from hybridcache.checkpoints.tiny import tiny_checkpoint
    model = hc.from_pretrained(tiny_checkpoint("jamba"), dtype=torch.float32)
    out = hc.generate(model, torch.randint(3, 300, (2, 9)), max_new_tokens=2)
    real_fsync = os.fsync
    def stall(fd):  # the file is fully written: stall before the rename, where a kill -9 leaves the temp file
        print("written", flush=True)
        time.sleep(600)
    os.fsync = stall
    out.cache.save(sys.argv[1])
    """
)


def test_a_saver_killed_mid_write_leaves_a_temp_file_that_the_next_save_removes(saved, tmp_path, checkpoints):
    model, cache, _ = saved
    checkpoints("jamba")  # built, so the child finds it under the same HYBRIDCACHE_HOME
    target = tmp_path / "c.safetensors"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(target)], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert child.stdout.readline().strip() == "written"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].stat().st_size > 1000 and not target.exists()  # what a kill -9 leaves
    # beside it: a temp name of a live writer (this process), a link of the same form, a file of another form
    live = tmp_path / f"{left[0].name.rsplit('-', 2)[0]}-{os.getpid()}-0123abcd.tmp"
    live.write_bytes(b"being written")
    other = tmp_path / ".c.safetensors.x1y2.tmp"
    other.write_bytes(b"not ours")
    cache.save(target, model=model)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([target.name, live.name, other.name])
    assert live.read_bytes() == b"being written" and other.read_bytes() == b"not ours"


def test_stale_temp_cleanup_never_follows_or_removes_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)  # a pid whose process has exited
    host = atomic_files._HOST  # this host's tag in temp names
    link = tmp_path / f".hc-{host}-{dead}-00000000.tmp"
    os.symlink(victim, link)
    regular = tmp_path / f".hc-{host}-{dead}-11111111.tmp"
    regular.write_bytes(b"left by a killed saver")
    assert remove_stale_temps(tmp_path) == [regular.name]
    assert link.is_symlink() and victim.read_bytes() == b"precious"


# -- item 9: the umask's mode -------------------------------------------------------------------------------------
def test_a_new_cache_file_gets_the_umask_mode_and_an_existing_one_keeps_its_own(saved, tmp_path):
    model, cache, _ = saved
    old = os.umask(0o027)
    try:
        cache.save(tmp_path / "new", model=model)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o640
    kept = tmp_path / "kept"
    kept.write_bytes(b"old")
    os.chmod(kept, 0o604)
    cache.save(kept, model=model)
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o604


# -- item 5: a cache is saved as the model that filled it -----------------------------------------------------------
def test_save_refuses_another_model_than_the_one_that_filled_the_cache(models, checkpoints, tmp_path):
    a = models("jamba")[0]
    b = hc.from_pretrained(checkpoints("jamba"), dtype=torch.float32)
    with torch.no_grad():
        next(b.parameters()).add_(1e-3)  # same family and config, other weights
    out = hc.generate(a, prompts(1, 7, seed=3), max_new_tokens=2)
    with pytest.raises(CacheError, match="filled by another model"):
        out.cache.save(tmp_path / "c", model=b)
    with pytest.raises(CacheError, match="filled by another model"):
        out.cache.save(tmp_path / "c", model=models("mamba")[0])
    with pytest.raises(CacheError, match="model must be the model"):
        out.cache.save(tmp_path / "c", model="jamba")
    assert list(tmp_path.iterdir()) == []
    twin = hc.from_pretrained(checkpoints("jamba"), dtype=torch.float32)  # another object, the same identity
    out.cache.save(tmp_path / "c", model=twin)
    Cache.load(tmp_path / "c", a)
    # a cache fed by plain forwards records its model too: saved without model=, loaded into it only
    cache = b.make_cache(1)
    b(prompts(1, 5, seed=4), cache)
    cache.save(tmp_path / "d")
    Cache.load(tmp_path / "d", b)
    with pytest.raises(CacheFileError, match="weights_sha256"):
        Cache.load(tmp_path / "d", a)

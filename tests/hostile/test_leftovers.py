"""What a failure leaves behind (issue "Reliability, second pass", item 8): offload files on a full disk, killed
kernel builds, a kernel build on a full disk, Cache.load onto a device that cannot hold data, sampling from
non-finite logits. Each failure is a named error (or, where the call cannot fail any more, a named notice), nothing
is left on disk and the cache is unchanged.

A full disk is real where the suite runs as root (a small tmpfs is mounted); the file size limit (RLIMIT_FSIZE)
variants run as any user. Both run in a subprocess: a process that hits a full disk through a memory mapping dies of
SIGBUS, and a file size limit is process-wide."""

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridcache as hc
import hybridcache.accel.native.kernels as ck
import hybridcache.accel.native.library as cpu_library
from hybridcache.accel.native import build as _native
from hybridcache.accel.runs.decode_run import DecodeRun
from hybridcache.cache import Cache, CacheError, NativeLayer
from hybridcache.cache.storage import offload as offload_storage
from tests.cache.helpers import state_equal
from tests.hostile.kit import report, run_cases
from tests.ops.test_native_build import FAST, status_and_notices

ROOT = Path(__file__).resolve().parents[2]
H, D = 2, 8
TOKEN_BYTES = H * D * 4  # one token's keys (or values) in one layer, float32: 64 bytes


# -- a. offload storage on a full disk ------------------------------------------------------------------------------
def offload_pair(layers=2, **build):
    native = [NativeLayer("full", {"num_kv_heads": H, "head_dim": D})] * layers
    return [Cache.build(native, 1, {"attention": {"storage": s}}, **build) for s in ("offload", "dense")]


def feed(cache, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 1, H, tokens, D, generator=g)
    with cache.block(None, tokens):
        for layer in cache.layers:
            layer.update(kv[0], kv[1])


def same_keys(a, b):
    return all(
        torch.equal(x.keys_data, y.keys_data) and torch.equal(x.values_data, y.values_data)
        for x, y in zip(a.layers, b.layers)
    )


def attempt(call):
    """(error class name, message) of what call() raised, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported to the parent process
        return [type(e).__name__, str(e)]
    return None


def scenario_full_disk():
    """Run in a subprocess with HYBRIDCACHE_OFFLOAD_DIR on a 64 KiB tmpfs (16 pages of 4 KiB)."""
    import warnings

    directory = os.environ["HYBRIDCACHE_OFFLOAD_DIR"]
    out = {}
    out["static"] = attempt(lambda: offload_pair(max_length=2000))  # 2 x 2 x 128000 bytes at construction
    out["after_static"] = os.listdir(directory)
    cache, dense = offload_pair()
    for c in (cache, dense):
        feed(c, 4, 0)  # 4 files of one page each: 48 KiB free
    before = cache.snapshot()
    out["big"] = attempt(lambda: feed(cache, 2000, 1))  # 2 x 128256 bytes in layer 0 alone
    out["big_unchanged"] = state_equal(cache.snapshot(), before) and cache.columns == 4
    # 320 tokens: 20480 bytes (5 pages) a part, 40 KiB a layer: each layer alone fits in 48 KiB, both do not
    out["two_layers"] = attempt(lambda: feed(cache, 316, 2))
    out["two_layers_unchanged"] = state_equal(cache.snapshot(), before) and cache.columns == 4
    out["after_refusals"] = os.listdir(directory)
    for c in (cache, dense):
        feed(c, 1, 3)  # fits: the cache goes on as the dense one does
    out["continues_exactly"] = same_keys(cache, dense) and cache.columns == 5
    # a full disk at a batch operation's commit (no update before it to check room): the part stays in memory
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # ENOSPC: the disk is full
        pass
    finally:
        os.close(fd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["repeat"] = attempt(lambda: cache.repeat(3))
    dense.repeat(3)
    out["repeat_notices"] = sorted({str(w.message) for w in caught if w.category is offload_storage.OffloadNotice})
    out["repeat_exact"] = same_keys(cache, dense) and cache.batch_size == 3
    os.unlink(filler)
    out["left"] = os.listdir(directory)
    print(json.dumps(out))


def scenario_file_size_limit():
    """Run in a subprocess under RLIMIT_FSIZE = 64 KiB (a file size limit: EFBIG, which the free space does not show
    in advance)."""
    import warnings

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    directory = os.environ["HYBRIDCACHE_OFFLOAD_DIR"]
    out = {"static": attempt(lambda: offload_pair(max_length=2000))}
    out["after_static"] = os.listdir(directory)
    cache, dense = offload_pair()
    for c in (cache, dense):
        feed(c, 4, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["big"] = attempt(lambda: feed(cache, 2000, 1))  # 128256-byte files: over the limit, at the commit
    feed(dense, 2000, 1)
    out["notices"] = sorted({str(w.message) for w in caught if w.category is offload_storage.OffloadNotice})
    out["exact"] = same_keys(cache, dense) and cache.columns == 2004
    for c in (cache, dense):
        feed(c, 1, 2)
    out["continues_exactly"] = same_keys(cache, dense)
    out["left"] = os.listdir(directory)
    print(json.dumps(out))


def run_scenario(name, env):
    proc = subprocess.run(
        [sys.executable, "-c", f"import tests.hostile.test_leftovers as t; t.{name}()"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the scenario died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/small (root only: mount(2) needs it)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 64 KiB tmpfs needs root; the RLIMIT_FSIZE and statvfs tests cover the same code")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here ({done.stderr.decode().strip()[:200]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_offload_on_a_full_disk_is_refused_by_name_and_leaves_nothing(small_tmpfs):
    out = run_scenario("scenario_full_disk", {"HYBRIDCACHE_OFFLOAD_DIR": str(small_tmpfs)})
    assert out["static"][0] == "CacheError" and "no space left on device" in out["static"][1], out["static"]
    assert out["after_static"] == []
    need_one_layer = 2 * 2004 * TOKEN_BYTES  # 256512 bytes, in whole pages: 2 x 32 x 4096
    assert out["big"] == [
        "CacheError",
        f"offload storage: no space left on device at {small_tmpfs}: this block's keys and values need "
        f"{2 * 32 * 4096} bytes there, {12 * 4096} are free (set HYBRIDCACHE_OFFLOAD_DIR to a directory with room)",
    ], (out["big"], need_one_layer)
    assert out["big_unchanged"]
    two_layers = 2 * 2 * 320 * TOKEN_BYTES  # 81920: the claim of the whole block, not of its last layer
    assert out["two_layers"][0] == "CacheError" and f"need {two_layers} bytes there" in out["two_layers"][1]
    assert out["two_layers_unchanged"] and out["after_refusals"] == []
    assert out["continues_exactly"]
    assert out["repeat"] is None and out["repeat_exact"]
    assert out["repeat_notices"] and all("no space left on device" in n for n in out["repeat_notices"])
    assert out["left"] == []


def test_offload_over_a_file_size_limit_fails_by_name_and_leaves_nothing(tmp_path):
    out = run_scenario("scenario_file_size_limit", {"HYBRIDCACHE_OFFLOAD_DIR": str(tmp_path)})
    assert out["static"][0] == "CacheError" and "file too large" in out["static"][1], out["static"]
    assert out["after_static"] == []
    # a limit the directory's free space does not show: the commit cannot fail half way, the parts stay in memory
    assert out["big"] is None and out["exact"] and out["continues_exactly"]
    assert out["notices"] == [
        f"hybridcache: offload storage: cannot park {2004 * TOKEN_BYTES} bytes in {tmp_path}: file too large (set "
        "HYBRIDCACHE_OFFLOAD_DIR to a directory with room); it stays in memory on cpu"
    ]
    assert out["left"] == []


def test_offload_checks_room_before_the_block_changes_anything(tmp_path, monkeypatch):
    """As a nearly full disk shows itself (statvfs), without filling one: any user."""
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    cache, dense = offload_pair()
    for c in (cache, dense):
        feed(c, 3, 0)
    real = os.statvfs

    def nearly_full(path):
        st = real(path)
        fields = list(st)
        fields[4] = fields[3] = 2  # f_bfree, f_bavail: two blocks
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", nearly_full)
    before = cache.snapshot()
    unit = real(tmp_path).f_frsize
    with pytest.raises(CacheError, match=f"no space left on device at {tmp_path}: .* {2 * unit} are free"):
        feed(cache, -(-unit // TOKEN_BYTES) * 4, 1)  # two blocks a part
    assert state_equal(cache.snapshot(), before) and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "statvfs", real)
    for c in (cache, dense):
        feed(c, 2, 2)
    assert same_keys(cache, dense)


def test_unusable_offload_directories_are_named(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    bad = {
        "missing": tmp_path / "missing",
        "a regular file": a_file,
        "below a regular file": a_file / "sub",
        "a dangling link": dangling,
        "a too long name": tmp_path / ("x" * 300),
    }
    cache, _ = offload_pair()
    feed(cache, 2, 0)
    before = cache.snapshot()

    def case(directory):
        def call():
            monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(directory))
            feed(cache, 3, 1)

        return call

    def unchanged():
        monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
        return None if state_equal(cache.snapshot(), before) else "the cache changed"

    problems = run_cases("offload directory", [(f"offload dir {k}", case(v)) for k, v in bad.items()], unchanged)
    assert not problems, report(problems, len(bad))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling"]


# -- b. build directories a killed kernel build left ----------------------------------------------------------------
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """As tests/ops/test_native_build.py's: a loader that has loaded nothing, building into tmp_path/kernels."""
    monkeypatch.setattr(cpu_library, "_state", {})
    monkeypatch.setattr(_native, "BASE_FLAGS", list(FAST))
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HYBRIDCACHE_DISABLE_KERNELS", raising=False)
    return tmp_path / "kernels"


STEM = "cpu_decode-0123456789abcdef"


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def planted(kdir, name, age_s=0.0, inside=True):
    path = kdir / name
    path.mkdir()
    if inside:
        (path / "out.so").write_bytes(b"\x7fELF half a library")
    if age_s:
        t = os.stat(path).st_mtime - age_s
        os.utime(path, (t, t))
    return path


def test_stale_build_directories_are_removed_by_the_next_build_and_only_they(fresh, tmp_path):
    fresh.mkdir(mode=0o700, parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = dead_pid()
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "keep.txt").write_text("not the kernel directory's")
        gone = {
            "dead pid": planted(fresh, f".build-{STEM}-p{dead}-a1b2c3"),
            "dead pid, empty": planted(fresh, f".build-{STEM}-p{dead}-d4e5", inside=False),
            "no pid, 2 hours old (before pids were recorded)": planted(fresh, f".build-{STEM}-x8y9z0", 7200),
            "a live pid, 2 hours old (no build takes that long)": planted(
                fresh, f".build-{STEM}-p{sleeper.pid}-q1", 7200
            ),
        }
        kept = {
            "this process's": planted(fresh, f".build-{STEM}-p{os.getpid()}-mine1", 7200),
            "a live process's": planted(fresh, f".build-{STEM}-p{sleeper.pid}-live1"),
            "no pid, fresh": planted(fresh, f".build-{STEM}-fresh1"),
            "not ours (no build key)": planted(fresh, f".build-p{dead}-other", 7200),
            "not ours (another prefix)": planted(fresh, f".builder-{STEM}-p{dead}-x", 7200),
            "an absurd pid, fresh": planted(fresh, f".build-{STEM}-p{10**30}-big"),
        }
        link = fresh / f".build-{STEM}-p{dead}-link"
        link.symlink_to(outside, target_is_directory=True)
        a_file = fresh / f".build-{STEM}-p{dead}-file"
        a_file.write_text("a file, not a build directory")
        kept.update({"a link to a directory (never followed)": link, "a regular file": a_file})
        if os.geteuid() == 0:  # another user's directory: never touched
            other = planted(fresh, f".build-{STEM}-p{dead}-uid", 7200)
            os.chown(other, 12345, 12345)
            kept["another user's"] = other
        status, _ = status_and_notices()
        assert status.startswith("C kernels: "), status
        left = [what for what, path in gone.items() if os.path.lexists(path)]
        lost = [what for what, path in kept.items() if not os.path.lexists(path)]
        assert not left and not lost, f"left: {left}; removed: {lost}"
        assert (outside / "keep.txt").read_text() == "not the kernel directory's" and link.is_symlink()
        assert (kept["a live process's"] / "out.so").exists()  # untouched inside too
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_build_names_its_own_directory_by_pid(fresh, monkeypatch):
    """The pid the cleanup reads is in the name of every build directory (seen while the compiler runs)."""
    seen = []
    real = _native.subprocess.run

    def spy(argv, **kw):
        if "-o" in argv:
            seen.extend(p.name for p in fresh.glob(".build-*"))
        return real(argv, **kw)

    monkeypatch.setattr(_native.subprocess, "run", spy)
    assert ck.kernel_status().startswith("C kernels: ")
    assert seen and all(_native._BUILD_DIR.fullmatch(n) and f"-p{os.getpid()}-" in n for n in seen), seen
    assert not list(fresh.glob(".build-*"))


# -- c. a kernel build on a full disk --------------------------------------------------------------------------------
LD_ENOSPC = "/usr/bin/ld: final link failed: No space left on device\ncollect2: error: ld returned 1 exit status\n"


def fake_compiler(tmp_path, stderr):
    cc = tmp_path / "fakecc"
    cc.write_text(
        "#!/bin/sh\n"
        'case "$1" in --version) echo "fakecc 1.0"; exit 0;; -dumpmachine) echo x86_64-linux-gnu; exit 0;; esac\n'
        f"cat >&2 <<'EOF'\n{stderr}EOF\nexit 1\n"
    )
    cc.chmod(0o755)
    return str(cc)


def test_a_linker_out_of_space_is_reported_as_no_space(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, LD_ENOSPC))
    status, notices = status_and_notices()
    prefix = f"torch path: the C kernels did not build: no space left on device at {fresh}"
    assert status.startswith(prefix), status
    assert len(notices) == 1 and not list(fresh.glob(".build-*"))


def test_a_failed_build_on_a_nearly_full_disk_names_the_disk(fresh, monkeypatch):
    """The compiler's message does not say why (any failure), the free space does: less than 1 MiB."""
    monkeypatch.setattr(_native, "BASE_FLAGS", [*FAST, "-include", "/nonexistent/header.h"])
    real = os.statvfs

    def kernel_dir_full(path):
        fields = list(real(path))
        if os.path.realpath(path) == os.path.realpath(fresh):
            fields[3] = fields[4] = 0  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", kernel_dir_full)
    status, _ = status_and_notices()
    assert status == f"torch path: the C kernels did not build: no space left on device at {fresh} (0 bytes free)"


def test_an_ordinary_compile_error_is_still_the_compilers(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "k.c:1:1: error: expected ';' before 'int'\n"))
    status, _ = status_and_notices()
    assert status == "torch path: the C kernels did not build (k.c:1:1: error: expected ';' before 'int')"


@pytest.mark.parametrize(
    "size,what", [("160k", "the source fits, the linked library does not"), ("32k", "not even the source copy fits")]
)
def test_a_kernel_build_on_a_real_full_disk(fresh, monkeypatch, tmp_path, size, what):
    home = tmp_path / "home"
    home.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the two tests above cover the same code")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(home)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here ({done.stderr.decode().strip()[:200]})")
    try:
        monkeypatch.setenv("HYBRIDCACHE_HOME", str(home))
        kdir = home / "kernels"
        status, notices = status_and_notices()
        assert status.startswith(f"torch path: the C kernels did not build: no space left on device at {kdir} ("), (
            what,
            status,
        )
        assert len(notices) == 1 and sorted(p.name for p in kdir.iterdir()) == [".lock"]
        with torch.no_grad():
            assert ck.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None  # the torch path runs
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


# -- d. Cache.load onto a device that cannot hold the saved values ---------------------------------------------------
@pytest.fixture(scope="module")
def saved_cache(checkpoints, tmp_path_factory):
    model = hc.from_pretrained(checkpoints("gemma3"))
    out = hc.generate(model, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2)
    path = tmp_path_factory.mktemp("saved") / "c.safetensors"
    out.cache.save(path, model)
    return model, path, out.cache


def test_cache_load_refuses_devices_that_cannot_hold_it_before_any_work(saved_cache, tmp_path):
    model, path, original = saved_cache
    cuda = torch.cuda.is_available()
    bad = [
        "meta",
        torch.device("meta"),
        "meta:0",
        "nonsense",
        "",
        "cuda:" + str(torch.cuda.device_count() + 7),
        -1,
        True,
        False,
        1.5,
        [1],
        b"meta",
        object(),
        "mps",
        "xla",
        "hpu",
    ]
    if not cuda:  # else these are usable GPUs
        bad += ["cuda", "cuda:0", 0, 1, torch.device("cuda")]
    missing = tmp_path / "no-such-file.safetensors"
    cases = []
    for device in bad:
        for where, p in (("a saved cache", path), ("a missing file", missing)):
            cases.append((f"device={device!r}, {where}", lambda d=device, p=p: Cache.load(p, model, device=d)))
    problems = run_cases("Cache.load device", cases)
    assert not problems, report(problems, len(cases))
    # before any work: the device is named, not the missing file
    with pytest.raises(CacheError, match=r"Cache.load: device 'meta' holds shapes, not the saved values"):
        Cache.load(missing, model, device="meta")
    for device in (None, "cpu", torch.device("cpu"), "cpu:0", b"cpu", *(["cuda", 0] if cuda else [])):  # as torch
        loaded = Cache.load(path, model, device=device)
        expected = torch.device("cpu") if device is None else torch.device(device)
        assert loaded.device.type == expected.type
        assert state_equal(loaded.snapshot(), original.snapshot()) or loaded.device.type != "cpu"


# -- e. generating from logits that are not finite -------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def poisoned(checkpoints, tmp_path_factory):
    """poisoned(name) -> (a model loaded with allow_nonfinite=True, the generation step whose logits are the first
    not finite). The first token the clean model generates from PROMPT has a NaN embedding row in "nan-embedding"."""
    from safetensors.torch import load_file, save_file

    clean = hc.from_pretrained(checkpoints("gemma3"))
    first = int(hc.generate(clean, PROMPT, max_new_tokens=1, decode_runs=False).sequences[0, -1])
    made = {}

    def get(name):
        if name not in made:
            target = tmp_path_factory.mktemp(name)
            shutil.copytree(checkpoints("gemma3"), target, dirs_exist_ok=True)
            state = load_file(target / "model.safetensors")
            step = 1
            if name == "nan-embedding":
                state["model.embed_tokens.weight"][first] = NAN
                step = 2  # the prompt is finite; the first token's row is not
            elif name == "nan-mlp":
                state["model.layers.1.mlp.up_proj.weight"][3, 5] = NAN
            else:
                state["model.norm.weight"][3] = {"nan-norm": NAN, "inf-norm": INF, "-inf-norm": -INF}[name]
            save_file(state, target / "model.safetensors")
            made[name] = (hc.from_pretrained(target, allow_nonfinite=True), step)
        return made[name]

    get.clean = clean
    return get


PROMPT = torch.tensor([[5, 6, 7, 8]])
POISONS = ["nan-norm", "inf-norm", "-inf-norm", "nan-mlp", "nan-embedding"]
MODES = {
    "greedy": {"decode_runs": False},
    "sample": {"do_sample": True},
    "sample, temperature 0.5": {"do_sample": True, "temperature": 0.5},
    "sample, top_k 5": {"do_sample": True, "top_k": 5},
    "sample, top_p 0.9": {"do_sample": True, "top_p": 0.9},
    "sample, all three": {"do_sample": True, "temperature": 2.0, "top_k": 3, "top_p": 0.5},
    "sample, two rows": {"do_sample": True, "rows": 2},
    "greedy, output_logits": {"output_logits": True, "decode_runs": False},
}


def test_non_finite_logits_are_a_named_error_at_their_step(poisoned):
    cases = []
    for poison in POISONS:
        model, step = poisoned(poison)
        for mode, kw in MODES.items():
            if step > 1 and kw.get("do_sample"):  # the poisoned row is the greedy choice's: sampling may miss it
                continue
            kw = dict(kw)
            ids = PROMPT.repeat(kw.pop("rows", 1), 1)

            def call(model=model, ids=ids, kw=kw, step=step):
                try:
                    hc.generate(model, ids, max_new_tokens=4, seed=0, **kw)
                except hc.models.core.base.GenerationError as e:
                    said = rf"generation step {step}: the logits are not finite \(row 0( \(and 1 more\))?: "
                    assert re.search(said, str(e)), str(e)
                    raise

            cases.append((f"{poison}, {mode}", call))
        beam = lambda m=model: hc.beam_search(m, PROMPT, num_beams=2, max_new_tokens=3)  # noqa: E731
        speculative = lambda m=model: hc.generate(m, PROMPT, max_new_tokens=4, draft_model=poisoned.clean)  # noqa: E731
        cases += [(f"{poison}, beam search", beam), (f"{poison}, the target of speculative decoding", speculative)]
    problems = run_cases("non-finite logits", cases)
    assert not problems, report(problems, len(cases))


def test_what_a_logits_processor_makes_of_the_scores_is_checked(poisoned):
    """Checked after the processors: one that empties a row or writes NaN is named; one that replaces non-finite
    values (as transformers' InfNanRemoveLogitsProcessor) lets a NaN model's generation go on."""
    model, _ = poisoned("nan-norm")
    clean = poisoned.clean

    def mask_all(ids, scores):
        return torch.full_like(scores, -INF)

    def write_nan(ids, scores):
        return scores.index_fill(-1, torch.tensor([7]), NAN)

    def replace(ids, scores):
        return torch.nan_to_num(scores, nan=0.0, posinf=torch.finfo(scores.dtype).max)

    cases = [
        (f"{name}, {mode}", lambda p=p, kw=kw: hc.generate(clean, PROMPT, max_new_tokens=3, logits_processor=[p], **kw))
        for name, p in (("a processor masking every token", mask_all), ("a processor writing NaN", write_nan))
        for mode, kw in (("greedy", {}), ("sample", {"do_sample": True, "seed": 0}))
    ]
    problems = run_cases("non-finite logits", cases)
    assert not problems, report(problems, len(cases))
    with pytest.raises(hc.models.core.base.GenerationError, match="row 0: -inf for every token"):
        hc.generate(clean, PROMPT, max_new_tokens=3, logits_processor=[mask_all])
    for kw in ({}, {"do_sample": True, "seed": 0, "top_k": 4}):
        out = hc.generate(model, PROMPT, max_new_tokens=3, logits_processor=[replace], **kw)
        assert out.sequences.shape == (1, 7)
    # -inf for some tokens is masking, not an error: the greedy choice avoids them
    ban = hc.generate(
        clean, PROMPT, max_new_tokens=1, logits_processor=[lambda ids, s: s.index_fill(-1, torch.tensor([0]), -INF)]
    )
    assert int(ban.sequences[0, -1]) != 0


def test_greedy_decode_runs_check_the_logits_too(poisoned):
    """Greedy decode runs (batch 1, no processors) choose tokens in C (hc_decode_steps); a NaN first seen after step
    1 is reported there too, after the tokens before it, and the run's cache is let go unchanged."""
    model, step = poisoned("nan-embedding")
    with pytest.raises(hc.models.core.base.GenerationError, match=f"generation step {step}: the logits are not finite"):
        hc.generate(model, PROMPT, max_new_tokens=4)
    # a continuation: the greedy C loop takes every step of it (its first token included); the cache is unchanged
    cache = model.make_cache(1)
    model(PROMPT[:, :-1], cache)
    before = cache.snapshot()
    calls = []
    real = DecodeRun.greedy

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    DecodeRun.greedy = counted
    try:
        with pytest.raises(
            hc.models.core.base.GenerationError, match=f"step {step}: the logits are not finite \\(row 0: NaN"
        ):
            hc.generate(model, PROMPT, cache=cache, max_new_tokens=4)
    finally:
        DecodeRun.greedy = real
    assert calls, "the greedy C loop did not run"
    after = cache.snapshot()
    assert after.columns == before.columns and torch.equal(after.fingerprint, before.fingerprint)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for a, b in zip(after.layers, before.layers) for n in a.tensors)

"""Build and load the C kernels like a package manager would: never load a library this code did not build.

`load_library(name, source, symbols)` compiles the C file `source`, which may include the C files beside it: every
`*.c` and `*.h` file of its directory is part of the build (digested, and copied into the build). It returns a loaded
`ctypes.CDLL` only when all of this holds, else None and a one-line reason (the caller's torch path runs; one warning
per process where something is wrong or missing):
- the kernel directory ($HYBRIDCACHE_HOME/kernels) is a directory owned by this user and writable by nobody else
  (group / others), and so are the library and its manifest (regular files, not links);
- the manifest `<name>-<key>.json` next to `<name>-<key>.so` records the build digest this process expects (sha256
  over every source file's name and bytes, the compiler flags, the compiler's path, version and target, and the
  CPU's model and flags) and the library's size and sha256, and the file has exactly that size and sha256. All of
  this is checked on an open file descriptor BEFORE anything is loaded (dlopen runs a library's constructors): a
  planted, swapped or truncated library is never mapped. On Linux the library is then loaded through that same
  descriptor (/proc/self/fd/N), so what was verified is what runs;
- after loading, every expected symbol is present.
A library that is missing, truncated or does not match its manifest (or has none) is rebuilt: the source files are
copied into a private temporary directory in the kernel directory, compiled there, hashed, then moved over the old
name (os.replace, atomic) and its manifest written the same way, under a file lock so that concurrent processes build
once. A directory or file that fails the ownership / permission checks is never rebuilt or loaded: torch path.
A build directory is named `.build-<name>-<key>-p<pid>-*`; one left by a build that was killed is removed by the next
build (under the lock, so no build is running): its pid is dead, or it is older than any build can take
(STALE_BUILD_S). A build that fails for want of room says "no space left on device at <dir>" (from the compiler's
or the OS's error, or from the free space where it writes), not the linker's last words.

Portability: x86-64 only (AVX2 / AVX-512 code, scalar otherwise); other machines (ARM: no NEON code yet) get the
torch path with a one-line notice, as does a system without a C compiler. A compiler that refuses -fopenmp (Apple
clang) builds the kernels without OpenMP (one thread each), and says so once.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from hybridcache.util.paths import home_dir

SOURCE_DIR = Path(__file__).with_name("csrc")
BASE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]
OPENMP_FLAGS = ["-fopenmp"]
LIBS = ["-lm"]
X86 = ("x86_64", "amd64", "i386", "i686", "x86")
MANIFEST_FORMAT = 1
_MAX_MANIFEST_BYTES = 1 << 16
COMPILE_TIMEOUT_S = 600
STALE_BUILD_S = 3600  # a build directory this old is no build's: a build holds the lock COMPILE_TIMEOUT_S at most
_BUILD_DIR = re.compile(r"\.build-[A-Za-z0-9_.]+-[0-9a-f]{16}-(?:p(\d+)-)?[A-Za-z0-9_]+")  # ours, pid or not
_SHORT_OF_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_LOW_ROOM_BYTES = 1 << 20  # less than this free where a build writes: it failed for want of room


class KernelNotice(UserWarning):
    """The C kernels do not run here (or run reduced: without OpenMP): which path runs instead, and why."""


class _Refused(Exception):
    """Torch path: `reason` for the status line; `warn`: say so once (False for an explicit opt-out)."""

    def __init__(self, reason: str, warn: bool = True):
        super().__init__(reason)
        self.reason, self.warn = reason, warn


@dataclass
class Loaded:
    lib: ctypes.CDLL
    file: str  # the library's file name in the kernel directory
    openmp: bool
    compiler: str  # first line of `cc --version`
    note: str | None  # what happened on the way (rebuilt, built without OpenMP), or None
    fd: int | None  # the verified descriptor the library was loaded through (kept open: see _dlopen)


def _run(argv: list[str]) -> str:
    env = {**os.environ, "LC_ALL": "C"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False).stdout


def find_compiler() -> list[str] | None:
    """argv of the C compiler: $CC (may carry arguments, e.g. "ccache gcc"), else cc / gcc / clang; None if none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        argv = shlex.split(cc)
        exe = shutil.which(argv[0])
        return [exe, *argv[1:]] if exe else None
    for name in ("cc", "gcc", "clang"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    return None


def cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    if sys.platform == "darwin":
        keys = ["machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features"]
        try:
            return platform.machine() + "\n" + _run(["sysctl", "-n", *keys])
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


SOURCE_SUFFIXES = (".c", ".h")


def read_sources(entry: Path) -> tuple[tuple[str, bytes], ...]:
    """(file name, bytes) of every C source and header in the entry file's directory, sorted by name: what a build
    compiles (the entry, and anything it includes from beside it) and digests."""
    files = sorted(p for p in entry.parent.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file())
    if entry.name not in {p.name for p in files}:
        raise FileNotFoundError(errno.ENOENT, "no such C source", str(entry))
    return tuple((p.name, p.read_bytes()) for p in files)


@dataclass(frozen=True)
class _Build:
    """What one build is made of; `key` digests all of it."""

    name: str
    entry: str  # the file compiled, one of the sources
    sources: tuple[tuple[str, bytes], ...]  # (file name, bytes): every file the compiler may read from beside it
    compiler: tuple[str, ...]
    compiler_id: str  # realpath, version and target of the compiler
    cpu: str
    flags: tuple[str, ...]

    @property
    def openmp(self) -> bool:
        return any(f in OPENMP_FLAGS for f in self.flags)

    @property
    def source_digest(self) -> str:
        """sha256 over the entry's name and every source file's name and bytes."""
        h = hashlib.sha256(self.entry.encode() + b"\0")
        for file, data in self.sources:
            h.update(json.dumps(file).encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\0")
        return h.hexdigest()

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        for part in (
            self.name,
            self.source_digest,
            self.compiler_id,
            self.cpu,
            json.dumps(self.flags),
            json.dumps(LIBS),
        ):
            h.update(part.encode() + b"\0")
        return h.hexdigest()

    @property
    def stem(self) -> str:
        return f"{self.name}-{self.key[:16]}"


def _compiler_id(cc: list[str]) -> tuple[str, str]:
    """(identity over realpath / version / target, the version's first line)."""
    version = _run([*cc, "--version"])
    target = _run([*cc, "-dumpmachine"]).strip()
    first = version.strip().splitlines()[0] if version.strip() else "unknown compiler"
    return "\n".join([os.path.realpath(cc[0]), *cc[1:], version, target]), first


def _private(st: os.stat_result, what: str) -> None:
    """Refuse what another user owns or can write (group / others)."""
    if st.st_uid != os.geteuid():
        raise _Refused(f"{what} is owned by uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
        raise _Refused(f"{what} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it")


def _open_private(name: str, dir_fd: int, what: str) -> int | None:
    """A read descriptor of regular file `name` in the directory, checked with _private; None if it is absent."""
    try:
        fd = os.open(
            name,
            os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0),
            dir_fd=dir_fd,
        )
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link
        raise _Refused(f"{what} cannot be opened safely ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"{what} is not a regular file")
        _private(st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256_fd(fd: int) -> tuple[str, int]:
    """(sha256, bytes) of what the descriptor reads from its start (read(), never mapped: a file truncated under us
    gives fewer bytes, not SIGBUS)."""
    h, size = hashlib.sha256(), 0
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def _verify(build: _Build, dir_fd: int, kdir: Path) -> tuple[int | None, str | None]:
    """(descriptor of the verified library, None), or (None, why it does not verify; None when nothing is there)."""
    so, manifest = build.stem + ".so", build.stem + ".json"
    mfd = _open_private(manifest, dir_fd, f"{kdir / manifest}")
    lfd = _open_private(so, dir_fd, f"{kdir / so}")
    try:
        if mfd is None:
            return None, (None if lfd is None else "it has no manifest")
        raw = os.read(mfd, _MAX_MANIFEST_BYTES + 1)
        try:
            record = json.loads(raw) if len(raw) <= _MAX_MANIFEST_BYTES else None
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("format") != MANIFEST_FORMAT:
            return None, "its manifest is unreadable"
        if record.get("build_key") != build.key or record.get("file") != so:
            return None, "its manifest records another build"
        if lfd is None:
            return None, "the library is missing"
        if os.fstat(lfd).st_size != record.get("size"):
            return None, "it is truncated or resized"
        digest, size = _sha256_fd(lfd)
        if size != record.get("size") or digest != record.get("sha256"):
            return None, "its sha256 does not match the manifest"
        fd, lfd = lfd, None
        return fd, None
    finally:
        for fd_ in (mfd, lfd):
            if fd_ is not None:
                os.close(fd_)


def _compile(build: _Build, dir_fd: int, kdir: Path) -> None:
    """Compile into a private temp directory in kdir, hash, then os.replace the library and its manifest."""
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{build.stem}-p{os.getpid()}-", dir=kdir))  # pid: see _remove_stale
    try:
        src = tmp / "src"
        src.mkdir()
        for file, data in build.sources:  # exactly the bytes digested, whatever happens to the checkout meanwhile
            (src / file).write_bytes(data)
        out = tmp / "out.so"
        proc = subprocess.run(
            [*build.compiler, *build.flags, str(src / build.entry), "-o", str(out), *LIBS],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        rel = f"{tmp.name}/out.so"
        fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o755)
            digest, size = _sha256_fd(fd)
        finally:
            os.close(fd)
        record = {
            "format": MANIFEST_FORMAT,
            "build_key": build.key,
            "file": build.stem + ".so",
            "size": size,
            "sha256": digest,
            "source_sha256": build.source_digest,
            "sources": {file: hashlib.sha256(data).hexdigest() for file, data in build.sources},
            "compiler": build.compiler_id.splitlines()[:2],
            "flags": list(build.flags),
            "libs": LIBS,
            "cpu_sha256": hashlib.sha256(build.cpu.encode()).hexdigest(),
            "openmp": build.openmp,
        }
        mrel = f"{tmp.name}/manifest.json"
        mfd = os.open(mrel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
        with os.fdopen(mfd, "w") as f:
            json.dump(record, f, indent=1)
        # the library first: a reader between the two renames sees a mismatch and waits for this lock
        os.replace(rel, build.stem + ".so", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.replace(mrel, build.stem + ".json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dlopen(fd: int, kdir: Path, file: str) -> ctypes.CDLL:
    """Load the verified file. Linux: through its descriptor, so no rename in between can swap it (the descriptor
    stays open while the library is loaded: the loader recognises a library by this name)."""
    proc_path = f"/proc/self/fd/{fd}"
    return ctypes.CDLL(proc_path if os.path.exists(proc_path) else str(kdir / file))


def _kernel_dir() -> tuple[Path, int]:
    kdir = home_dir("kernels")
    try:
        kdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(kdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _Refused(f"the kernel directory {kdir} is unusable ({e.strerror or e})") from None
    try:
        st = os.fstat(dir_fd)
        if not stat.S_ISDIR(st.st_mode):
            raise _Refused(f"{kdir} is not a directory")
        _private(st, f"the kernel directory {kdir}")
    except BaseException:
        os.close(dir_fd)
        raise
    return kdir, dir_fd


def load_library(name: str, source: Path, symbols: list[str], disabled: bool = False) -> tuple[Loaded | None, str]:
    """(the loaded library, None) or (None, the reason the torch path runs). Warns (KernelNotice) at most once per call;
    the caller calls once per process."""
    try:
        return _load(name, source, symbols, disabled), ""
    except OSError as e:  # e.g. a read-only kernel directory without a valid build, an I/O error while hashing
        reason = f"the kernel directory is unusable ({e})"
        warnings.warn(f"hybridcache: {reason}; using the torch path", KernelNotice, stacklevel=4)
        return None, reason
    except _Refused as e:
        if e.warn:
            warnings.warn(f"hybridcache: {e.reason}; using the torch path", KernelNotice, stacklevel=4)
        return None, e.reason


def _load(name: str, source: Path, symbols: list[str], disabled: bool) -> Loaded:
    if disabled:
        raise _Refused("kernels off (HYBRIDCACHE_DISABLE_KERNELS is set)", warn=False)
    machine = platform.machine().lower()
    if machine not in X86:
        raise _Refused(f"no C kernels for {platform.machine() or 'this machine'} (x86-64 AVX2 / AVX-512 code only)")
    if not hasattr(os, "geteuid") or sys.platform == "win32":
        raise _Refused(f"C kernels are not built on {sys.platform}")
    import fcntl  # POSIX only, as is everything below

    cc = find_compiler()
    if cc is None:
        how = f"$CC={os.environ['CC']!r} not found" if os.environ.get("CC", "").strip() else "set CC"
        raise _Refused(f"no C compiler found ({how})")
    try:
        compiler_id, compiler = _compiler_id(cc)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Refused(f"the C compiler {cc[0]} does not run ({e})") from None
    try:
        sources = read_sources(source)
    except OSError as e:
        raise _Refused(f"the C sources in {source.parent} cannot be read ({e.strerror or e})") from None
    cpu = cpu_identity()
    builds = [
        _Build(name, source.name, sources, tuple(cc), compiler_id, cpu, tuple(BASE_FLAGS + OPENMP_FLAGS)),
        _Build(name, source.name, sources, tuple(cc), compiler_id, cpu, tuple(BASE_FLAGS)),
    ]
    kdir, dir_fd = _kernel_dir()
    try:
        fd, note, build = None, None, builds[0]
        for build in builds:  # the OpenMP build if present in any form; the one without only if that is all there is
            fd, why = _verify(build, dir_fd, kdir)
            if fd is not None or why is not None:
                break
        if fd is None:
            lock = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait, then find its result
                fd, build, note = _build_locked(builds, dir_fd, kdir)
            finally:
                os.close(lock)
        try:
            lib = _dlopen(fd, kdir, build.stem + ".so")
        except OSError as e:
            os.close(fd)
            raise _Refused(f"{build.stem}.so does not load ({e})") from None
        missing = [s for s in symbols if not hasattr(lib, s)]
        if missing:
            raise _Refused(f"{build.stem}.so lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if not build.openmp:
            why = f"{compiler} does not take -fopenmp"
            warnings.warn(f"hybridcache: {why}: the C kernels run on one thread", KernelNotice, stacklevel=4)
            note = f"{note}; " if note else ""
            note += f"built without OpenMP: {why}"
        return Loaded(lib, build.stem + ".so", build.openmp, compiler, note, fd)
    finally:
        os.close(dir_fd)


def _pid_alive(pid: int) -> bool | None:
    """Whether process `pid` lives (None: no such pid can exist, e.g. too large)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError, OSError):
        return None
    return True


def _remove_stale(dir_fd: int) -> list[str]:
    """Under the build lock (no build runs): remove the build directories killed builds left, i.e. our
    `.build-*` directories (real directories owned by this user; links are never followed) whose pid is dead or
    that are older than STALE_BUILD_S; never this process's own. Returns their names."""
    if not shutil.rmtree.avoids_symlink_attacks:  # rmtree by descriptor only
        return []
    removed = []
    try:
        names = os.listdir(dir_fd)
    except OSError:  # housekeeping: never a reason not to build
        return []
    for name in names:
        match = _BUILD_DIR.fullmatch(name)
        if match is None:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        pid = int(match.group(1)) if match.group(1) else None
        if pid == os.getpid():
            continue
        if (pid is not None and _pid_alive(pid) is False) or time.time() - st.st_mtime > STALE_BUILD_S:
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
            removed.append(name)
    return removed


def _short_of_room(kdir: Path, texts: list[str], codes: list[int | None]) -> str | None:
    """ "no space left on device at <dir> (N bytes free)" where a failed build ran out of room, as the OS's error
    code or the compiler's or linker's message says, or as less than _LOW_ROOM_BYTES free shows in the kernel
    directory or the compiler's temporary directory (the first of them that low is named, else the kernel
    directory); None otherwise."""
    said = [_SHORT_OF_ROOM[c] for c in codes if c in _SHORT_OF_ROOM]
    said += [w for w in _SHORT_OF_ROOM.values() for t in texts if w in t.lower()]
    places = []
    for place in dict.fromkeys([str(kdir), tempfile.gettempdir()]):
        try:
            st = os.statvfs(place)
        except OSError:
            continue
        places.append((place, st.f_bavail * st.f_frsize))
    low = [(place, free) for place, free in places if free < _LOW_ROOM_BYTES]
    if not said and not low:
        return None
    place, free = (low or places or [(str(kdir), None)])[0]
    return f"{said[0] if said else 'no space left on device'} at {place}" + (
        f" ({free} bytes free)" if free is not None else ""
    )


def _build_locked(builds: list[_Build], dir_fd: int, kdir: Path) -> tuple[int, _Build, str | None]:
    """Under the build lock: what another process built meanwhile, else a fresh build (OpenMP first)."""
    reasons = []
    for build in builds:
        fd, why = _verify(build, dir_fd, kdir)
        if fd is not None:
            return fd, build, None
        if why is not None:
            reasons.append(f"{build.stem}.so: {why}")
    note = None
    if reasons:  # something was there and did not verify: say so, then replace it
        note = f"rebuilt: {'; '.join(reasons)}"
        warnings.warn(f"hybridcache: in {kdir}, {'; '.join(reasons)}: rebuilding it", KernelNotice, stacklevel=5)
    _remove_stale(dir_fd)
    errors, codes = [], []
    for build in builds:
        try:
            _compile(build, dir_fd, kdir)
        except subprocess.CalledProcessError as e:
            errors.append((e.stderr or e.stdout or str(e)).strip())
            continue
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
            codes.append(getattr(e, "errno", None))
            continue
        fd, why = _verify(build, dir_fd, kdir)
        if fd is None:
            raise _Refused(f"the fresh build {build.stem}.so does not verify ({why})")
        return fd, build, note
    lines = errors[0].splitlines() if errors else []
    first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "unknown error")
    room = _short_of_room(kdir, errors, codes)
    if room is not None:  # the linker's "collect2: error: ld returned 1" would hide the cause
        raise _Refused(f"the C kernels did not build: {room}")
    raise _Refused(f"the C kernels did not build ({first.strip()[:300]})")

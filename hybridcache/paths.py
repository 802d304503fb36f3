"""Where hybridcache keeps what it builds once: $HYBRIDCACHE_HOME, else ~/.cache/hybridcache (XDG respected); and
how it writes a file whole or not at all (`write_atomically`: results, recordings, figures)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def home_dir(*parts: str) -> Path:
    """$HYBRIDCACHE_HOME/<parts>, else $XDG_CACHE_HOME (or ~/.cache)/hybridcache/<parts>."""
    home = os.environ.get("HYBRIDCACHE_HOME")
    if home:
        return Path(home).expanduser().joinpath(*parts)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser().joinpath("hybridcache", *parts)


def build_checkpoint_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` (a checkpoint directory, complete once it has config.json), built by `build(tmp)` in a private
    directory beside it and renamed into place: a reader never sees half a checkpoint, a failed build leaves nothing,
    and of two processes building it at once the first rename wins and the other's result is dropped."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def current_umask() -> int:
    """The process's umask, read without changing it (/proc/self/status on Linux). Elsewhere it is set and put back,
    which a file created by another thread at that instant would see: the fallback only."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` as `open(path, "w")` would (a new file gets 0666 & ~umask, an existing file keeps its
    mode, a symlink's target is written) but atomically: a temp file beside it, synced, then renamed onto it, so a
    reader sees the old bytes or all the new ones, and a failure (a full disk, an interrupt) leaves the old file as it
    was and no temp file behind. A path that is not a regular file (/dev/stdout, /dev/full, a pipe) is written in
    place: there is nothing to rename onto it."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    try:
        st = os.stat(path)  # what a plain open() would reach, through any link
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if st is not None and (not stat.S_ISREG(st.st_mode) or _via_dev_or_proc(path)):  # e.g. /dev/stdout to a file
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as e:
            if e.errno is not None and e.filename is None:  # a failed write names no file: name the one meant
                e.filename = str(path)
            raise
        return path
    target = Path(os.path.realpath(path)) if path.is_symlink() else path  # a link stays; its file is replaced
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~current_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:64]}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, mode)  # mkstemp's 0600 would hide a results file from the user's group
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # name the file meant
            e.filename = str(path)
        raise
    return path


def _via_dev_or_proc(path: Path) -> bool:
    """Whether `path` or a link on its way is under /dev or /proc (/dev/stdout -> /proc/self/fd/1 -> a redirected
    log): such a file is another process's open stream, written in place, never replaced by a new file."""
    for _ in range(40):  # the kernel's own limit on links followed
        text = os.path.abspath(path)
        if text.startswith(("/dev/", "/proc/")):
            return True
        if not os.path.islink(text):
            return False
        path = Path(os.path.join(os.path.dirname(text), os.readlink(text)))
    return False

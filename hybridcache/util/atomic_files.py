"""Writing a file the way a careful tool does: all or nothing, with the mode a plain `open()` would give, and no temp
file left behind by a process that was killed mid-write. Two entry points: `write_atomically` for files we own (a
saved cache: never over anything but a regular file, never through a link) and `write_output` for outputs the user
names (results, records, figures: as `open(path, "w")` would, /dev/stdout and /dev/full included).

A write goes to a temp file beside the target (same filesystem: the final rename is atomic), created exclusively and
without following symlinks; it is synced, then renamed onto the target. Temp names are short and fixed in form,
`.hc-<host>-<pid>-<random>.tmp`, so a target name of any legal length can be written (NAME_MAX is 255 bytes) and a
later write in the same directory can tell which temp files belong to a process of this host that is gone (killed
during a write) and remove them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
import stat
from pathlib import Path

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TEMP = re.compile(r"^\.hc-([0-9a-f]{6})-([0-9]{1,10})-[0-9a-f]{8}\.tmp$")


def current_umask() -> int:
    """The process's umask, read without changing it (/proc/self/status on Linux). Elsewhere it is set and put back,
    which a file created by another thread at that instant would see: the fallback only."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def user_file_mode() -> int:
    """The mode a new file gets from `open()` under this process's umask."""
    return 0o666 & ~current_umask()


def check_replaceable(path: Path, error: type[Exception], what: str) -> None:
    """Refuse (with `error`) a target that exists and is neither a regular file nor a symlink (a FIFO, a device node,
    a socket, a directory: renaming onto it would replace it, e.g. /dev/null), or whose directory does not exist.
    A symlink is replaced by the file, never followed (a link planted at the target cannot redirect the write)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise error(f"{what}: cannot use {path}: {e.strerror or e}") from None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        kind = _kind(st.st_mode)
        raise error(f"{what}: {path} is {kind}, not a regular file; refusing to replace it (choose another path)")
    parent = path.parent
    if not parent.is_dir():
        raise error(f"{what}: the directory {parent} does not exist (or is not a directory)")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's live process (or a pid no process can have)
        return True
    return True


def remove_stale_temps(directory: Path) -> list[str]:
    """Remove the temp files in `directory` left by writers of this host whose process is gone (killed mid-write):
    only names of our own form, only regular files owned by this user, never through a symlink. Returns their
    names. A live writer's temp file (its pid runs) is left alone; so is anything we cannot tell."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMP.match(name)
        if m is None or m.group(1) != _HOST or _pid_alive(int(m.group(2))):
            continue
        try:
            st = os.lstat(directory / name)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(directory / name)
                removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed


def _replace(target: Path, data: bytes | memoryview, mode: int, recheck=None) -> None:
    """The temp file beside `target` (our short name, exclusive, never through a link), `mode`, the bytes, synced,
    renamed onto `target`; on any failure it is removed and `target` is unchanged. `recheck()` runs just before the
    rename (a target swapped meanwhile)."""
    remove_stale_temps(target.parent)
    tmp = target.parent / f".hc-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if recheck is not None:
            recheck()
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomically(path: Path, data: bytes | memoryview, error: type[Exception], what: str) -> None:
    """Write a file we own (a saved cache) all or nothing: a target that is not a regular file is refused with
    `error` (`what` names the caller) before anything is written, a symlink at the target is replaced, never
    followed; a new file gets the umask's mode, an existing regular file keeps its own. The OS's own failures (no
    space, read-only) propagate as OSError, with nothing left behind."""
    path = Path(path)
    check_replaceable(path, error, what)
    try:
        old = os.stat(path, follow_symlinks=False)
        mode = stat.S_IMODE(old.st_mode) if stat.S_ISREG(old.st_mode) else user_file_mode()
    except FileNotFoundError:
        mode = user_file_mode()
    _replace(path, data, mode, lambda: check_replaceable(path, error, what))


def write_output(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write an output the user named (results, recordings, figures) as `open(path, "w")` would (a new file gets
    0666 & ~umask, an existing file keeps its mode, a symlink's target is written) but atomically: a reader sees the
    old bytes or all the new ones, and a failure (a full disk, an interrupt) leaves the old file as it was and no
    temp file behind. A path that is not a regular file (/dev/stdout, /dev/full, a pipe) is written in place: there
    is nothing to rename onto it. OS failures propagate as OSError naming the path."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    try:
        st = os.stat(path)  # what a plain open() would reach, through any link
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    try:
        if st is not None and (not stat.S_ISREG(st.st_mode) or _via_dev_or_proc(path)):  # e.g. /dev/stdout to a file
            with open(path, "wb") as f:
                f.write(data)
            return path
        target = Path(os.path.realpath(path)) if path.is_symlink() else path  # a link stays; its file is replaced
        _replace(target, data, stat.S_IMODE(st.st_mode) if st is not None else user_file_mode())
    except OSError as e:
        if e.errno is not None and e.filename is None:  # a failed write names no file: name the one meant
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

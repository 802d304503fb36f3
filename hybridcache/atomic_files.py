"""Writing a file the way a careful tool does: all or nothing, never over something that is not a regular file, with
the mode a plain `open()` would give, and no temp file left behind by a process that was killed mid-write.

A write goes to a temp file beside the target (same filesystem: the final rename is atomic), created exclusively and
without following symlinks; it is synced, then renamed onto the target. Temp names are short and fixed in form,
`.hc-<host>-<pid>-<random>.tmp`, so a target name of any legal length can be written (NAME_MAX is 255 bytes) and a
later write in the same directory can tell which temp files belong to a process of this host that is gone (killed
during a write) and remove them.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import stat
from pathlib import Path

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TEMP = re.compile(r"^\.hc-([0-9a-f]{6})-([0-9]{1,10})-[0-9a-f]{8}\.tmp$")


def user_file_mode() -> int:
    """The mode a new file gets from `open()` under this process's umask (0o666 & ~umask). Read from
    /proc/self/status on Linux: setting the umask to read it would race with other threads creating files."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


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


def write_atomically(path: Path, data: bytes | memoryview, error: type[Exception], what: str) -> None:
    """Write `data` to `path` all or nothing: on any failure (a full disk, an interrupt) the temp file is removed and
    `path` is unchanged. A new file gets the umask's mode, an existing regular file keeps its own. A refused target
    raises `error` (`what` names the caller); the OS's own failures (no space, read-only) propagate as OSError."""
    path = Path(path)
    check_replaceable(path, error, what)
    remove_stale_temps(path.parent)
    tmp = path.parent / f".hc-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            old = os.stat(path, follow_symlinks=False)
            mode = stat.S_IMODE(old.st_mode) if stat.S_ISREG(old.st_mode) else user_file_mode()
        except FileNotFoundError:
            mode = user_file_mode()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        check_replaceable(path, error, what)  # again: something may have been put there meanwhile
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise

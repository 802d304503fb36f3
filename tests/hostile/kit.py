"""The hostile-input suite's harness: what counts as a named error, how each generated input is run and judged, and
the counts per category (printed at the end of the session by conftest.py).

An input passes when its call raises a *named* error (a hybridcache error class, all ValueError subclasses, with a
message) and nothing changed (the check the test hands in: a cache equal to its snapshot, files on disk with the same
bytes and mtimes). Anything else is reported with the input's description: accepted, a bare Python / torch error,
an error without a message, a changed cache or file."""

import collections
import hashlib
import os
import random
from pathlib import Path

from hybridcache.cache.core.errors import CacheError
from hybridcache.models import ArgumentError, CheckpointError, ConfigError
from hybridcache.models.core.base import GenerationError
from hybridcache.reference import MalformedGeneration, RecordingMismatch, ReferenceAnswerError

NAMED = (
    CacheError,
    GenerationError,
    ConfigError,
    ArgumentError,
    CheckpointError,
    MalformedGeneration,
    RecordingMismatch,
    ReferenceAnswerError,
)
#: Inputs run per category in this session (conftest.py prints them; HYBRIDCACHE_HOSTILE_COUNTS=<file> writes JSON).
COUNTS: collections.Counter = collections.Counter()
SEED = 22  # issue 22; every generator derives its own random.Random from this and its name


class Accepted(Exception):
    """Raised by a case whose bad call returned normally (inside a block, so that the block is aborted)."""


def rng(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


def outcome(call) -> str | None:
    """None when call() raised a named error with a message, else what happened instead."""
    try:
        call()
    except NAMED as e:
        return None if str(e).strip() else f"{type(e).__name__} without a message"
    except FileNotFoundError as e:  # ours name the file ("no saved cache at ...", "shard ... is missing"); the
        if e.args and isinstance(e.args[0], str) and not str(e).startswith("[Errno"):  # OS's own are "[Errno 2]"
            return None
        return f"FileNotFoundError from the OS: {e}"
    except Accepted:
        return "accepted"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - judged and reported
        return f"{type(e).__module__}.{type(e).__qualname__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return "accepted"


def run_cases(category: str, cases, unchanged=lambda: None) -> list[str]:
    """Run every (description, call) of `cases`; returns the problems (empty when every input was refused by name
    and `unchanged()` -> None after each). Counts the inputs under `category`."""
    problems = []
    for description, call in cases:
        COUNTS[category] += 1
        why = outcome(call)
        changed = unchanged()  # always: a check may also put things back for the next input
        why = "; ".join(filter(None, [why, changed]))
        if why:
            problems.append(f"{description}: {why}")
    return problems


def report(problems: list[str], n: int | None = None) -> str:
    head = f"{len(problems)} bad inputs got through" + (f" (of {n})" if n else "")
    return "\n".join([head, *problems[:40]])


def tree_state(root, digest: bool = True) -> dict:
    """Every entry under `root` (links not followed): kind, size, mtime (and content digest) of files."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            if os.path.islink(p):
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p)] = (
                    "file",
                    st.st_size,
                    st.st_mtime_ns,
                    st.st_ino,
                    hashlib.sha256(p.read_bytes()).hexdigest() if digest else None,
                )
            else:
                out[str(p)] = ("dir",)
    return out


def files_unchanged(*roots):
    """A check for run_cases: None while every root's tree_state (sizes, mtimes, inodes) is what it was when this
    was called; `check.digests()` compares the contents too (once, after the cases: hashing per case is slow)."""
    before = {str(r): tree_state(r, digest=False) for r in roots}
    digests = {str(r): tree_state(r) for r in roots}

    def check():
        for r in roots:
            if tree_state(r, digest=False) != before[str(r)]:
                return f"files under {r} changed"
        return None

    check.digests = lambda: all(tree_state(r) == digests[str(r)] for r in roots)
    return check

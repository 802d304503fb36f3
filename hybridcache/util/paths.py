"""Where hybridcache keeps what it builds once: $HYBRIDCACHE_HOME, else ~/.cache/hybridcache (XDG respected)."""

from __future__ import annotations

import os
import shutil
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

"""Where hybridcache keeps what it builds once: $HYBRIDCACHE_HOME, else ~/.cache/hybridcache (XDG respected)."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir(*parts: str) -> Path:
    """$HYBRIDCACHE_HOME/<parts>, else $XDG_CACHE_HOME (or ~/.cache)/hybridcache/<parts>."""
    home = os.environ.get("HYBRIDCACHE_HOME")
    if home:
        return Path(home).expanduser().joinpath(*parts)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser().joinpath("hybridcache", *parts)

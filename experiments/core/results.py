"""The one writer of every experiment's results file (results.json, and the benchmark's / study's own json), and of
the other files a run leaves (console.log, figures, the sweep summary).

Each write is atomic (hybridcache.util.atomic_files.write_output): the bytes go to a temporary file in the same
directory,
which then replaces the old file with `os.replace` (one rename on the same filesystem), so a reader (a sweep summary,
a script polling a run) sees either the old results or the new ones, never half a file, and a failure mid-write (a
value that cannot be serialised, a full disk, an interrupt) leaves the old file as it was and no temporary file. A new
file gets the mode a plain open() gives it (0666 & ~umask), an existing one keeps its mode.

Every file carries `"schema_version"` (SCHEMA_VERSION, first key). Its history:
  1: the first versioned schema. Common keys: status (starting | running | ok | failed | error | crashed, by
     experiment), title, overrides, config; on an error: error, exit_code. Everything else is the experiment's own.
A reader that meets a newer version than it knows should say so rather than guess.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from hybridcache.util.atomic_files import write_output

SCHEMA_VERSION = 1
RESULTS = "results.json"


def write_results(out_dir: str | Path, result: dict[str, Any], name: str = RESULTS) -> Path:
    """Write `result` (with schema_version first) to `out_dir/name` atomically; return the path."""
    out_dir = Path(out_dir)
    body = {"schema_version": SCHEMA_VERSION, **{k: v for k, v in result.items() if k != "schema_version"}}
    text = json.dumps(body, indent=2, default=str)  # serialised before any file is touched
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_output(out_dir / name, text)


def write_text(path: str | Path, text: str) -> Path:
    """A run's other text output (console.log, a summary), atomically."""
    return write_output(path, text)


def save_figure(fig, path: str | Path, **kwargs: Any) -> Path:
    """`fig.savefig(path, **kwargs)`, drawn in memory first and written atomically (the format from the suffix)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or None, **kwargs)
    return write_output(path, buffer.getvalue())


def read_results(path: str | Path) -> dict[str, Any]:
    """A results file; one written before versioning (no schema_version) reads as version 0."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data.setdefault("schema_version", 0)
    return data

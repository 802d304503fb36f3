"""The one writer of every experiment's results file (results.json, and the benchmark's / study's own json).

Each write is atomic: the JSON goes to a temporary file in the same directory, which then replaces the old file with
`os.replace` (one rename on the same filesystem), so a reader (a sweep summary, a script polling a run) sees either
the old results or the new ones, never half a file, and a failure mid-write (a value that cannot be serialised, a
full disk, an interrupt) leaves the old file as it was.

Every file carries `"schema_version"` (SCHEMA_VERSION, first key). Its history:
  1: the first versioned schema. Common keys: status (starting | running | ok | failed | error | crashed, by
     experiment), title, overrides, config; on an error: error, exit_code. Everything else is the experiment's own.
A reader that meets a newer version than it knows should say so rather than guess.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RESULTS = "results.json"


def write_results(out_dir: str | Path, result: dict[str, Any], name: str = RESULTS) -> Path:
    """Write `result` (with schema_version first) to `out_dir/name` atomically; return the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    body = {"schema_version": SCHEMA_VERSION, **{k: v for k, v in result.items() if k != "schema_version"}}
    text = json.dumps(body, indent=2, default=str)  # serialised before any file is touched
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_results(path: str | Path) -> dict[str, Any]:
    """A results file; one written before versioning (no schema_version) reads as version 0."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data.setdefault("schema_version", 0)
    return data

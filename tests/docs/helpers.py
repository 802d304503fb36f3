"""What the docs tests share: the pages, their python blocks, and running a block as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: A python block runs unless the line before its fence says why not: <!-- docs-test: skip (an excerpt of x.py) -->
SKIP = re.compile(r"<!-- docs-test: skip \((?P<reason>[^)]+)\) -->")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    skip: str | None  # the stated reason, when the page marks the block as not runnable

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def blocks(paths: list[Path] | None = None) -> list[Block]:
    out = []
    for path in paths or pages():
        text = path.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.fullmatch(before.strip())
            line = text.count("\n", 0, match.start()) + 1
            name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            out.append(Block(name, line, match.group(1), skip and skip.group("reason")))
    return out


def run_code(code: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The block in a fresh interpreter at the repository root, tiny checkpoints built under `home` (once)."""
    env = {**os.environ, "HYBRIDCACHE_HOME": str(home), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )

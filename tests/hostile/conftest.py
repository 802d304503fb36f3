"""The hostile-input suite (issue 22): tiny checkpoints and models as in tests/models, and the counts per category
printed at the end of the session (and written as JSON to $HYBRIDCACHE_HOSTILE_COUNTS when that is set)."""

import json
import os

from tests.hostile.kit import COUNTS
from tests.models.conftest import checkpoints, models  # noqa: F401 - the same session fixtures as tests/models


def pytest_terminal_summary(terminalreporter):
    if not COUNTS:
        return
    total = sum(COUNTS.values())
    terminalreporter.write_sep("-", f"hostile inputs: {total} generated, each a named error with nothing changed")
    for category, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"  {category:<28} {n:>6}")
    if os.environ.get("HYBRIDCACHE_HOSTILE_COUNTS"):
        with open(os.environ["HYBRIDCACHE_HOSTILE_COUNTS"], "w") as f:
            json.dump({"total": total, **dict(sorted(COUNTS.items()))}, f, indent=1)

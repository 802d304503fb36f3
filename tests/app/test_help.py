"""`python run.py --help` says what the app does, lists each group's choices (not the schema groups a user never
picks), and gives examples that pass the command-line check; before torch is imported, exit status 0. Before: Hydra's
generic dump ("run is powered by Hydra", the schema groups, ~200 lines of composed config, no example)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from experiments.core.help import help_text
from experiments.core.usage import usage_error
from tests.app.test_cli_usage import CONFIGS, HEAVY, ROOT


def test_help_describes_the_app_with_its_choices_and_examples(tmp_path):
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "run.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not [m for m in imported if m.split(".")[0] in HEAVY]
    out = result.stdout
    assert "powered by Hydra" not in out and "== Config ==" not in out
    assert out.startswith("hybridcache: ") and "oracle" in out.split("\n\n")[0]
    assert "examples:" in out and "--hydra-help" in out and "Exit status" in out
    assert set(re.findall(r"^  (\w+): ", out, flags=re.M)) == {"cache", "experiment", "model", "prompts", "reference"}
    assert "jamba*" in out and "native*" in out and "correctness*" in out
    for path in (CONFIGS / "model").glob("*.yaml"):
        assert re.search(rf"\b{path.stem}\b", out), path.stem
    assert len(out.splitlines()) < 60  # a page, not a config dump


def test_every_example_in_the_help_passes_the_check():
    commands = re.findall(r"^  python run\.py (.*?)(?:\s+#.*)?$", help_text(CONFIGS), flags=re.M)
    assert len(commands) >= 6
    for command in commands:
        assert usage_error(shlex.split(command), CONFIGS) is None, command

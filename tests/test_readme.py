"""The README's Python examples run as written, and its set-up commands match what CI runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def run_block(code, tmp_path):
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path)}  # tiny checkpoints go to a temp dir
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    result = run_block(BLOCKS[index], tmp_path)
    assert result.returncode == 0, result.stderr


def test_readme_extension_examples_pass_the_kit_and_print_what_they_say(tmp_path):
    (sink,) = [b for b in BLOCKS if 'register_cache_layer("my_sink")' in b]
    out = run_block(sink, tmp_path).stdout.strip().splitlines()[-1]
    assert "'split == one-shot': 12" in out and "atomic failures" in out
    (codec,) = [b for b in BLOCKS if 'register_kv_codec("my_int8")' in b]
    assert run_block(codec, tmp_path).stdout.strip().splitlines()[-1] == "ok"
    (cache,) = [b for b in BLOCKS if "with cache.block(mask) as block:" in b]
    lines = run_block(cache, tmp_path).stdout
    assert "tensor([4, 6]) 6" in lines and "[-1, -1,  0,  1,  2]" in lines


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = re.findall(r"<!-- (run|test)-command -->\n```bash\n(.*?)\n```", README)
    assert [kind for kind, _ in commands] == ["run", "test"]
    assert "pytest" in commands[1][1] and "torch==2.13.0" in commands[1][1]
    assert "test-command" in (ROOT / ".ci" / "run").read_text()


def test_demo_runs():
    result = subprocess.run(
        [sys.executable, "examples/cache_demo.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "hybrid_chunked" in result.stdout

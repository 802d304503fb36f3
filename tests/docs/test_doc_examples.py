"""The docs' examples print what their text says they print (the blocks are found by their content, wherever they
are), and the demo the docs point to runs."""

import os
import subprocess
import sys

from tests.docs.helpers import ROOT, blocks, run_code

BLOCKS = [b for b in blocks() if b.skip is None]


def the_block(marker: str):
    """The one example holding `marker` (the README may repeat a page's example word for word)."""
    (code,) = {b.code for b in BLOCKS if marker in b.code}
    return next(b for b in BLOCKS if b.code == code)


def test_the_extension_examples_pass_the_kit_and_print_what_they_say(docs_home):
    out = run_code(the_block('register_cache_layer("my_sink")').code, docs_home).stdout.strip().splitlines()[-1]
    assert "'split == one-shot': 12" in out and "atomic failures" in out
    assert run_code(the_block('register_kv_codec("my_int8")').code, docs_home).stdout.strip().splitlines()[-1] == "ok"
    local = run_code(the_block('register_cache_layer("my_local")').code, docs_home).stdout.strip().splitlines()[-1]
    assert local == "1"  # the declared kernel form equals the pattern on every pair of positions


def test_the_cache_example_prints_its_positions_and_counts(docs_home):
    lines = run_code(the_block("with cache.block(mask) as block:").code, docs_home).stdout
    assert "tensor([4, 6]) 6" in lines and "[-1, -1,  0,  1,  2]" in lines


def test_the_cache_config_example_resolves_most_specific_first(docs_home):
    out = run_code(the_block("plan = resolve_plan(native, config)").code, docs_home).stdout.strip()
    assert out == "[('mamba', 'bfloat16'), ('chunked', 'int8'), ('sliding', 'int8')]"


def test_demo_runs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "examples/cache_demo.py"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    assert "hybrid_chunked" in result.stdout

"""Every ```python block of the docs pages and the README runs as written (tiny models only), unless the page says,
on the line before it, why it cannot run on its own."""

import pytest

from tests.docs.helpers import Block, blocks, run_code

BLOCKS = blocks()
#: Each distinct runnable block once, at its first page (the README repeats a page's example word for word).
UNIQUE = [b for i, b in enumerate(BLOCKS) if b.skip is None and b.code not in {c.code for c in BLOCKS[:i]}]


@pytest.mark.parametrize("block", UNIQUE, ids=str)
def test_python_block_runs(block: Block, docs_home):
    result = run_code(block.code, docs_home)
    assert result.returncode == 0, f"{block} failed:\n{result.stderr[-3000:]}"


def test_the_blocks_are_found_and_skips_say_why():
    runnable = [b for b in BLOCKS if b.skip is None]
    assert len(runnable) >= 10, [str(b) for b in BLOCKS]  # the README's and the pages' examples, not an empty scan
    assert all(b.skip.strip() for b in BLOCKS if b.skip is not None)


def test_a_block_that_fails_is_reported(tmp_path, docs_home):
    """The runner sees a failing block: the test above can fail."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nraise SystemExit('boom')\n```\n")
    (block,) = blocks([page])
    result = run_code(block.code, docs_home)
    assert result.returncode != 0 and "boom" in result.stderr


def test_the_skip_marker_is_read_from_the_line_before_the_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip (an excerpt of x.py) -->\n```python\nx = 1\n```\n\n<!-- docs-test: skip () -->\n"
        "```python\ny = 2\n```\n\n```python\nz = 3\n```\n"
    )
    skips = [b.skip for b in blocks([page])]
    assert skips == ["an excerpt of x.py", None, None]  # an empty reason is no skip: the block runs

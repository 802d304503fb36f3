"""The README is the way in: short, its set-up commands are what CI runs, and its links lead into the docs site.

Its Python blocks run with the docs' (tests/docs/test_doc_blocks.py)."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: What the README keeps (issue 41): what it is, the two set-up commands, the main run, a quick start, where to go.
MAX_LINES = 250


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = re.findall(r"<!-- (run|test)-command -->\n```bash\n(.*?)\n```", README)
    assert [kind for kind, _ in commands] == ["run", "test"]
    run = "pip install torch==2.13.0 && pip install -e . && python run.py model=jamba cache=hybrid_chunked"
    assert commands[0][1] == run
    assert "pytest" in commands[1][1] and "torch==2.13.0" in commands[1][1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci and '".[docs]"' in ci  # CI runs the test command with the docs extra installed


def test_readme_is_short():
    assert len(README.splitlines()) <= MAX_LINES, "move the detail into a docs/ page and link it"


def nav_pages(node) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        return set().union(*(nav_pages(v) for v in node.values()))
    return set().union(*(nav_pages(v) for v in node))


def test_readme_links_lead_to_pages_of_the_site():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 15
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for link in links:
        assert (ROOT / link).exists(), link
        assert link.removeprefix("docs/") in nav, f"{link} is not in mkdocs.yml's nav"


def test_every_section_of_the_site_is_reachable_from_the_readme():
    """Each top-level nav section has at least one page the README links to."""
    linked = {m.removeprefix("docs/") for m in re.findall(r"\]\((docs/[^)#]+)", README)}
    for section in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]:
        ((title, node),) = section.items()
        assert nav_pages(node) & linked, f"no README link into the docs section {title!r}"

"""The docs' option tables equal what docs/gen_tables.py makes from configs/ today (`python docs/gen_tables.py`)."""

import importlib.util
import shutil

import pytest
import yaml

from tests.docs.helpers import DOCS, ROOT

spec = importlib.util.spec_from_file_location("gen_tables", DOCS / "gen_tables.py")
gen_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_tables)


def test_the_committed_tables_match_the_configs():
    assert gen_tables.stale_pages(DOCS, ROOT / "configs", write=False) == [], "run: python docs/gen_tables.py"


def test_every_table_is_used_and_every_preset_listed():
    text = "".join(p.read_text() for p in DOCS.rglob("*.md"))
    assert {m.group(2) for m in gen_tables.MARKER.finditer(text)} == set(gen_tables.TABLES)
    presets = (DOCS / "cache_configs.md").read_text()
    for preset in (ROOT / "configs" / "cache").glob("*.yaml"):
        assert f"| `{preset.stem}` |" in presets


def copy_sources(tmp_path):
    """What the tables are made from, copied: configs/, the schema, pyproject.toml."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "experiments" / "core").mkdir(parents=True)
    shutil.copy(
        ROOT / "experiments" / "core" / "config_schema.py", tmp_path / "experiments" / "core" / "config_schema.py"
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "configs"


def test_a_new_preset_makes_the_page_stale(tmp_path):
    """A preset added to configs/ without regenerating: the check names the page, and the rewrite lists it."""
    configs, docs = copy_sources(tmp_path), tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (configs / "cache" / "my_window.yaml").write_text(
        "# A sliding window of 8 on every attention layer.\ndefaults:\n  - /cache_schema/base@_here_\n  - _self_\n"
        "attention:\n  type: sliding\n  window: 8\n"
    )
    assert "docs/cache_configs.md" in gen_tables.stale_pages(docs, configs, write=False)
    gen_tables.stale_pages(docs, configs, write=True)
    page = (docs / "cache_configs.md").read_text()
    assert "| `my_window` | `attention.type=sliding`, `attention.window=8` | A sliding window of 8" in page
    assert gen_tables.stale_pages(docs, configs, write=False) == []


def test_a_changed_default_and_comment_show(tmp_path):
    configs = copy_sources(tmp_path)
    path = configs / "experiment" / "benchmark.yaml"
    path.write_text(path.read_text().replace("repeats: 3               # medians over repeats", "repeats: 7  # seven"))
    assert "| `experiment.repeats` | `7` | seven |" in gen_tables.TABLES["settings_benchmark"](configs)


def test_a_new_schema_field_and_extra_show(tmp_path):
    configs = copy_sources(tmp_path)
    schema = configs.parent / "experiments" / "core" / "config_schema.py"
    schema.write_text(
        schema.read_text().replace('    device: str = "cpu"\n', '    device: str = "cpu"\n    x: int = 3  # new\n')
    )
    assert "| `model.x` | `int` | `3` | new |" in gen_tables.TABLES["model_fields"](configs)
    pyproject = configs.parent / "pyproject.toml"
    extra = '[project.optional-dependencies]\n# For y.\ny = ["y>=1"]\n'
    pyproject.write_text(pyproject.read_text().replace("[project.optional-dependencies]\n", extra))
    assert "| `y` | `y>=1` | For y. |" in gen_tables.TABLES["extras"](configs)


def test_an_unknown_table_is_a_named_error():
    with pytest.raises(KeyError, match="no_such_table"):
        gen_tables.render_page("<!-- generated: no_such_table -->\n<!-- end generated -->\n", ROOT / "configs")


def test_yaml_settings_reads_values_and_comments(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "defaults:\n  - a\nname: x   # the name\n# above b\nb: [1,\n    2]\nc:\n  d: 'x # not a comment'  # d's\n"
        "  e:\n    - {f: 1}\n    - {f: 2}\n"
    )
    rows = gen_tables.yaml_settings(path)
    assert rows == [
        ("name", "x", "the name"),
        ("b", "[1, 2]", "above b"),
        ("c", "", ""),
        ("c.d", "'x # not a comment'", "d's"),
        ("c.e", "[{f: 1}, {f: 2}]", ""),
    ]
    assert yaml.safe_load(rows[3][1]) == "x # not a comment"

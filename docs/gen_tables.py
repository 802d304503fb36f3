"""The docs' option tables, generated from configs/ and experiments/core/config_schema.py so they cannot drift.

A page asks for a table with a marker pair; this script fills in what lies between them:

    <!-- generated: cache_presets -->
    ... (rewritten by `python docs/gen_tables.py`) ...
    <!-- end generated -->

`python docs/gen_tables.py` rewrites every page under docs/; `--check` changes nothing and exits 1 naming each
stale table (tests/docs/test_generated_tables.py does the same check). The tables read `configs/`,
`experiments/core/config_schema.py` and `pyproject.toml` under `--root` (default: this repository). Nothing is imported
from hybridcache or experiments (no torch, no Hydra): the YAML files are read with PyYAML and their comments by line,
the schema's fields and comments from its source with `ast`.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)
KEY_LINE = re.compile(r"^(\s*)([\w.]+):(.*)$")


# -- reading the configs --------------------------------------------------------------------------------------------
def split_comment(text: str) -> tuple[str, str]:
    """'value   # comment' -> ('value', 'comment'); a '#' inside quotes or brackets of a flow value stays."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "#" and depth == 0 and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1 :].strip()
    return text.strip(), ""


def header_comment(path: Path) -> str:
    """The comment lines a YAML file starts with, joined into one paragraph."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def yaml_settings(
    path: Path, skip: tuple[str, ...] = ("defaults",), above_too: bool = True
) -> list[tuple[str, str, str]]:
    """(dotted key, value in YAML flow style, comment) for every key of a YAML file, in file order. The comment is the
    key's own ('key: value  # ...', continued on deeper-indented '#' lines), else (`above_too`) the '#' lines right
    above it. Keys under `skip`, and the items of block lists, are left out (a list shows as the value of its key)."""
    data = yaml.safe_load(path.read_text()) or {}
    rows: list[list[str]] = []
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    inside = None  # lines indented deeper than this belong to the previous key (a block list, a wrapped flow value)
    for line in path.read_text().splitlines():
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if not stripped:
            above = []
        elif stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if rows and stack and indent > stack[-1][0] and rows[-1][2] and not above:
                rows[-1][2] += " " + text
            else:
                above.append(text)
        elif inside is not None and indent > inside:
            continue
        elif stripped.startswith("- "):
            inside, above = (stack[-1][0] if stack else -1), []
        elif match := KEY_LINE.match(line):
            inside = None
            key, (value, comment) = match.group(2), split_comment(match.group(3))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key))
            if value.count("[") + value.count("{") > value.count("]") + value.count("}"):
                inside = indent  # a flow value wrapped over the next lines
            dotted = ".".join(k for _, k in stack)
            if dotted.split(".")[0] not in skip:
                rows.append([dotted, flow(lookup(data, dotted)), comment or (" ".join(above) if above_too else "")])
            above = []
    return [tuple(r) for r in rows]


def lookup(data, dotted: str):
    for key in dotted.split("."):
        data = data[key] if key in data else data[int(key)]
    return data


def flow(value, mappings: bool = False) -> str:
    """A parsed YAML value as one line of YAML flow style ('' for a mapping unless `mappings`: its keys get rows of
    their own)."""
    if isinstance(value, dict) and value and not mappings:
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return text.removesuffix("\n...").strip()


def schema_fields(source: Path, cls: str) -> list[tuple[str, str, str, str]]:
    """(field, type, default, comment) of a dataclass in experiments/core/config_schema.py, read from its source."""
    text = source.read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = []
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    default = ast.get_source_segment(text, item.value) if item.value is not None else ""
                    default = re.sub(r"field\(default_factory=(\w+)\)", r"\1()", default or "")
                    default = re.sub(r"field\(default_factory=lambda: (.*)\)", r"\1", default)
                    _, comment = split_comment(lines[item.end_lineno - 1][item.end_col_offset :])
                    out.append((item.target.id, ast.get_source_segment(text, item.annotation), default, comment))
            return out
    raise KeyError(f"no class {cls} in {source}")


def choices(configs: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (configs / group).glob("*.yaml"))


def defaults(configs: Path) -> dict[str, str]:
    """The default choice of each config group, from configs/config.yaml's defaults list."""
    out = {}
    for entry in yaml.safe_load((configs / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            ((group, name),) = entry.items()
            out[group] = name
    return out


def flatten(node, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(node, dict) and node:
        return [kv for k, v in node.items() for kv in flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, node)]


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def code(text: object) -> str:
    return f"`{text}`" if str(text) != "" else ""


# -- the tables ------------------------------------------------------------------------------------------------------
def app_groups(configs: Path) -> str:
    """The config groups of run.py and their choices (the default first)."""
    default = defaults(configs)
    rows = []
    for group in ("model", "cache", "reference", "prompts", "experiment"):
        names = choices(configs, group)
        names = [default[group]] + [n for n in names if n != default[group]] if group in default else names
        listed = ", ".join(f"`{n}`" + (" (default)" if n == default.get(group) else "") for n in names)
        rows.append([f"`{group}`", str(len(names)), listed])
    return table(["group", "choices", "names"], rows)


def cache_presets(configs: Path) -> str:
    """Every cache preset: what it sets on top of the schema, and its own comment."""
    rows = []
    for name in choices(configs, "cache"):
        path = configs / "cache" / f"{name}.yaml"
        data = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
        sets = ", ".join(f"`{k}={v}`" for k, v in flatten(data)) or "nothing (native types)"
        rows.append([f"`{name}`", sets, header_comment(path)])
    return table(["preset (`cache=`)", "sets", "what it does"], rows)


def cache_fields(configs: Path) -> str:
    """Every field a cache config takes, from the schema's three entry types."""
    source = configs.parent / "experiments" / "core" / "config_schema.py"
    rows = []
    for name, kind, default, comment in schema_fields(source, "CacheSchema"):
        if kind in ("AttentionEntry", "RecurrentEntry"):
            continue
        rows.append([f"`cache.{name}`", code(kind), code(default), comment])
    for prefix, cls in (("attention / full / sliding / chunked", "AttentionEntry"), ("recurrent", "RecurrentEntry")):
        for name, kind, _, comment in schema_fields(source, cls):
            rows.append([f"`{name}` under {prefix}", code(kind), "`None`", comment])
    return table(["field", "type", "default", "meaning"], rows)


def model_choices(configs: Path) -> str:
    """Every `model=` choice: its family and where its weights come from."""
    rows = []
    for name in choices(configs, "model"):
        path = configs / "model" / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        checkpoint = data.get("checkpoint")
        if checkpoint is None:
            weights = "random, built once (`size: " + str(data.get("size", "tiny")) + "`)"
        elif "real:" in str(checkpoint):
            weights = "shipped / converted: " + code(checkpoint)
        else:
            weights = code(checkpoint)
        rows.append([f"`{name}`", f"`{data['family']}`", weights, header_comment(path)])
    return table(["`model=`", "family", "weights", "note"], rows)


def reference_choices(configs: Path) -> str:
    rows = []
    for name in choices(configs, "reference"):
        settings = yaml_settings(configs / "reference" / f"{name}.yaml")
        note = next((c for k, _, c in settings if k == "name"), "")
        extra = ", ".join(f"`{k}`" for k, _, _ in settings if k != "name")
        rows.append([f"`{name}`", note, extra])
    return table(["`reference=`", "what it is", "settings"], rows)


def experiment_choices(configs: Path) -> str:
    rows = []
    for name in choices(configs, "experiment"):
        path = configs / "experiment" / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        parents = [d for d in data.get("defaults", []) if isinstance(d, str) and not d.startswith(("/", "_"))]
        note = header_comment(path) or next((c for k, _, c in yaml_settings(path) if k == "name"), "")
        rows.append([f"`{name}`", ", ".join(f"`{p}`" for p in parents), note])
    return table(["`experiment=`", "extends", "what it is"], rows)


def app_settings(configs: Path) -> str:
    """The top-level settings of configs/config.yaml, plus generation.* and logger.*."""
    rows = [
        [f"`{k}`", code(v), c]
        for k, v, c in yaml_settings(configs / "config.yaml", skip=("defaults", "hydra", "cache_name", "model_name"))
        if v != ""
    ]
    return table(["setting", "default", "meaning"], rows)


def model_fields(configs: Path) -> str:
    source = configs.parent / "experiments" / "core" / "config_schema.py"
    comments = {k: c for k, _, c in yaml_settings(configs / "model" / "jamba.yaml")}
    fields = schema_fields(source, "ModelSchema")
    rows = [[f"`model.{n}`", code(t), code(d), c or comments.get(n, "")] for n, t, d, c in fields]
    return table(["field", "type", "default", "meaning"], rows)


def experiment_settings(name: str):
    """The settings of configs/experiment/<name>.yaml with their values and comments (a study's strategies and
    references apart: see study_strategies)."""

    def render(configs: Path) -> str:
        rows = [
            [f"`experiment.{k}`", code(v), c]
            for k, v, c in yaml_settings(configs / "experiment" / f"{name}.yaml")
            if not k.startswith(("strategies", "references")) and not (v == "" and not c)
        ]
        return table(["setting", "value", "meaning"], rows)

    return render


def study_strategies(configs: Path) -> str:
    """The study's named strategies: each a cache config."""
    path = configs / "experiment" / "study.yaml"
    comments = {k: c for k, _, c in yaml_settings(path, above_too=False)}
    strategies = yaml.safe_load(path.read_text())["strategies"]
    rows = [
        [f"`{name}`", code(flow(config, mappings=True)), comments.get(f"strategies.{name}", "")]
        for name, config in strategies.items()
    ]
    return table(["strategy", "cache config", "note"], rows)


def extras(configs: Path) -> str:
    """pyproject.toml's optional extras: what each installs, and the comment above it."""
    rows, above, inside = [], [], False
    for line in (configs.parent / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            inside = line.strip() == "[project.optional-dependencies]"
        elif inside and line.startswith("#"):
            above.append(line.lstrip("#").strip())
        elif inside and (match := re.match(r"^([\w-]+) = (\[.*\])", line)):
            packages = ", ".join(f"`{p}`" for p in yaml.safe_load(match.group(2)))
            rows.append([f"`{match.group(1)}`", packages, " ".join(above)])
            above = []
        elif not line.strip():
            above = []
    return table(["extra", "installs", "what for"], rows)


TABLES = {
    "extras": extras,
    "app_groups": app_groups,
    "app_settings": app_settings,
    "cache_presets": cache_presets,
    "cache_fields": cache_fields,
    "model_choices": model_choices,
    "model_fields": model_fields,
    "reference_choices": reference_choices,
    "experiment_choices": experiment_choices,
    "study_strategies": study_strategies,
    **{f"settings_{n}": experiment_settings(n) for n in ("benchmark", "study", "press_check", "train")},
}


# -- pages -----------------------------------------------------------------------------------------------------------
def render_page(text: str, configs: Path) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown generated table {name!r} (known: {', '.join(sorted(TABLES))})")
        return match.group(1) + TABLES[name](configs) + match.group(4)

    return MARKER.sub(fill, text)


def stale_pages(docs: Path, configs: Path, write: bool) -> list[str]:
    """Pages whose generated tables differ from what configs/ gives now (rewritten when `write`)."""
    stale = []
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text()
        fresh = render_page(text, configs)
        if fresh != text:
            stale.append(str(page.relative_to(docs.parent)))
            if write:
                page.write_text(fresh)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="read configs/, experiments/core/config_schema.py, pyproject.toml there"
    )
    args = parser.parse_args(argv)
    stale = stale_pages(ROOT / "docs", args.root / "configs", write=not args.check)
    for page in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {page}")
    if args.check and stale:
        print("run: python docs/gen_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The import graph of hybridcache/ and experiments/, read from the AST of every module (every import statement,
module level, inside functions and under `if TYPE_CHECKING`): no cycles, and no import from a lower layer into a
higher one. The layer order is docs/architecture.md's:

    base (paths) < cache core < ops < nn < accel < models < generation < tools < experiments / app

`cache` and `ops` are independent of each other (cache holds no kernels, kernels know no cache); the order only
says neither may import nn, models or anything above. A module in a layer may import its own layer and below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (layer, packages), lowest first: each layer is a set of packages (a module belongs to the layer of its longest
# matching prefix). docs/architecture.md draws the same table.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("hybridcache.util",)),  # where files live, atomic writes, silencing other libraries
    ("cache", ("hybridcache.cache",)),  # the Cache and its layer types: pure torch, no kernels
    # pure-torch ops; they reach the C kernels only through the seam ops/kernels.py, which accel plugs into
    ("ops", ("hybridcache.ops",)),
    ("nn", ("hybridcache.nn",)),  # the model's torch modules: mixers, MLPs, MoE, norms
    # the CPU fast path: C kernels and their wrappers, and what runs mixers and layers by them (it knows nn)
    ("accel", ("hybridcache.accel",)),
    ("models", ("hybridcache.models", "hybridcache.checkpoints")),
    ("generation", ("hybridcache.generation",)),
    # the public facade (hybridcache/__init__.py) and the library's tools around the core: planning, reports,
    # reference runners, the conformance kit, experiment tracking, the HF bridge
    (
        "tools",
        (
            "=hybridcache",  # "=": this module only, not everything under it
            "hybridcache.tools",
            "hybridcache.reference",
            "hybridcache.testing",
            "hybridcache.hf",
        ),
    ),
    ("experiments", ("experiments", "run")),
]

# Known violations in files other helpers are changing now, each named; remove an entry when its file is fixed.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_files(root: Path, packages: tuple[str, ...] = ("hybridcache", "experiments"), scripts=("run.py",)):
    """{module name: path} of every .py file under the packages, plus top-level scripts."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    for script in scripts:
        if (root / script).is_file():
            mods[Path(script).stem] = root / script
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project modules it imports}. `from pkg import name` points at pkg.name when that is a module
    (importing a submodule), else at pkg; relative imports are resolved; imports of other libraries are dropped."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as one concrete cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_path(graph, comp) for comp in components]


def _cycle_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A cycle a -> b -> ... -> a through the component's first module (breadth-first back to it)."""
    start = min(comp)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def layer_of(mod: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact = p.startswith("=")
            p = p.removeprefix("=")
            if (mod == p or (not exact and mod.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"module {mod} belongs to no layer: add it to LAYERS in tests/test_architecture.py")
    return rank


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in graph.items() for b in bs if layer_of(b) > layer_of(a))


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files(ROOT))


def test_no_import_cycles(graph):
    cycles = [c for c in find_cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_upward_imports(graph):
    bad = [(a, b) for a, b in upward_imports(graph) if (a, b) not in KNOWN_UPWARD]
    names = [name for name, _ in LAYERS]
    assert not bad, "imports from a lower layer into a higher one:\n" + "\n".join(
        f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]})" for a, b in bad
    )


def test_known_exceptions_are_still_real(graph):
    """An exception whose violation is gone must be removed, so the list never hides a new one."""
    cycles = {frozenset(c) for c in find_cycles(graph)}
    assert KNOWN_CYCLES <= cycles, f"no longer cycles, remove from KNOWN_CYCLES: {KNOWN_CYCLES - cycles}"
    assert KNOWN_UPWARD <= set(upward_imports(graph))


def test_every_module_has_a_layer(graph):
    for mod in graph:
        layer_of(mod)


def test_the_graph_sees_every_kind_of_import(graph):
    # sanity of the reader on known edges: module level, `from pkg import submodule`, a relative-free package import
    assert "hybridcache.cache.io.persistence" in graph["hybridcache.cache.core.cache"]
    assert "hybridcache.cache" in graph["hybridcache.models.core.base"]
    assert "experiments.core.mqar" in graph["experiments.study.data"]  # an import inside a function


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_cycle_is_found_and_reported(tmp_path):
    # a tiny synthetic package: a -> b at module level, b -> c inside a function, c -> a via a relative import
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    import pkg.c\n",
            "pkg/c.py": "from .a import thing\n",
            "pkg/d.py": "import os\nfrom pkg.a import x\n",  # d imports into the cycle but is not on it
        },
    )
    graph = import_graph(module_files(tmp_path, packages=("pkg",), scripts=()))
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    with pytest.raises(AssertionError, match=r"pkg\.a -> pkg\.b -> pkg\.c -> pkg\.a"):
        test_no_import_cycles(graph)


def test_an_acyclic_package_passes_and_type_checking_imports_count(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "x = 1\n"})
    assert find_cycles(import_graph(module_files(tmp_path, packages=("pkg",), scripts=()))) == []
    _write(tmp_path, {"pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import y\n"})
    assert find_cycles(import_graph(module_files(tmp_path, packages=("pkg",), scripts=()))) == [
        ["pkg.a", "pkg.b", "pkg.a"]
    ]


def test_a_planted_upward_import_is_found():
    graph = {"hybridcache.cache.core.cache": {"hybridcache.models.core.base"}, "hybridcache.models.core.base": set()}
    assert upward_imports(graph) == [("hybridcache.cache.core.cache", "hybridcache.models.core.base")]
    with pytest.raises(
        AssertionError, match=r"hybridcache.cache.core.cache \(cache\) imports hybridcache.models.core.base"
    ):
        test_no_upward_imports(graph)

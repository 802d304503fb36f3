"""A byte-budget planner for hybrid caches: one option per cache layer, the least summed cost within a byte budget.

An option is a `layers:` cache-config entry a layer may take ({} keeps its native type, `{"type": "sliding",
"window": 16}`, `{"storage": "int4"}`, `{"state_codec": "int8"}`). `build_tables` resolves every (layer, option)
through `resolve_plan` and takes its bytes from the resolved spec for a `Scenario`; the costs are measured elsewhere
(experiments/study/budget_planner.py: KL to the native next-token distribution with only that layer changed). Costs are
taken as additive over layers (a first-order model: cross-layer interactions are not measured), so planning is a
multiple-choice knapsack: minimize sum cost[l, o_l] subject to sum bytes[l, o_l] <= budget.

It is solved exactly by a sparse DP over reachable byte sums: after each layer only the Pareto-optimal (bytes, cost)
partial allocations are kept. Not a DP over discretized bytes: layer bytes are large integers, and rounding them either
breaks the budget (down) or loses the optimum (up), while the non-dominated sums stay few. Not a Lagrangian: it only
reaches allocations on the convex hull of the front and can miss the best one under a given budget. One solve gives the
whole front, so a sweep of budgets costs one DP. `max_front` bounds the work: a larger front is thinned by byte
buckets (bytes stay exact, so allocations stay within budget, but `Front.exact` turns False: no longer proven optimal).

    tables = build_tables(model.native_layers(), {"attention": {...}, "recurrent": {...}}, Scenario(1, 32, 48))
    tables = [t.with_costs({name: cost, ...}) for t in tables]
    choice = plan_budget(tables, budget=200_000)   # choice.config: a cache config the library accepts
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybridcache.cache.core.base import LayerSpec
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.plan import format_bytes, resolve_plan
from hybridcache.cache.methods.press_schedule import tokens_held

NATIVE = "native"


class BudgetTooSmall(ValueError):
    """The budget is below the smallest configuration the options allow; `minimum` says what that takes."""

    def __init__(self, budget: int, minimum: int) -> None:
        super().__init__(
            f"byte budget {budget} ({format_bytes(budget)}) is below the smallest configuration the "
            f"options allow: {minimum} bytes ({format_bytes(minimum)})"
        )
        self.budget, self.minimum = budget, minimum


class PlannerError(ValueError):
    """Bad planner input (no layers, a layer without options, a bad scenario)."""


@dataclass(frozen=True)
class Scenario:
    """What bytes are counted for: `batch` rows, a `prompt_len`-token prompt fed as one block, then tokens one by one
    up to `context_len` seen. An option's bytes are its peak held between blocks over that decoding."""

    batch: int
    prompt_len: int
    context_len: int

    def __post_init__(self) -> None:
        if not (self.batch >= 1 and 1 <= self.prompt_len <= self.context_len):
            raise PlannerError(f"a scenario needs batch >= 1 and 1 <= prompt_len <= context_len, got {self}")


@dataclass(frozen=True)
class Option:
    name: str
    entry: Mapping[str, Any]
    nbytes: int
    cost: float = 0.0


@dataclass(frozen=True)
class LayerTable:
    """The options of one cache layer (`address` as `layers:` writes it: "3" or "3.attention")."""

    address: str
    kind: str
    options: tuple[Option, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # option name -> why the layer refuses it

    def with_costs(self, costs: Mapping[str, float]) -> LayerTable:
        """The same options with measured costs (options missing from `costs` keep theirs)."""
        return replace(self, options=tuple(replace(o, cost=float(costs.get(o.name, o.cost))) for o in self.options))

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


def spec_nbytes(spec: LayerSpec, s: Scenario) -> int:
    """Peak bytes a layer of `spec` holds between blocks while the scenario decodes from prompt_len to context_len.

    Bytes grow with the tokens seen except under a chunk (they fall back at each chunk boundary), so the peak is at
    context_len or within the last chunk. Prefill-mode scored eviction keeps its compressed prompt plus every later
    token (ScoredEvictionLayer.min_nbytes), which the spec alone, seeing no prompt, cannot tell."""
    chunk = getattr(spec, "chunk_size", None) or 1
    return max(_nbytes_at(spec, s, t) for t in range(max(s.prompt_len, s.context_len - chunk + 1), s.context_len + 1))


def _nbytes_at(spec: LayerSpec, s: Scenario, tokens: int) -> int:
    if getattr(spec, "schedule", None) in ("prefill", "decoding", "prefill_decoding") and hasattr(spec, "kept_of"):
        needed = tokens_held(spec, s.prompt_len, tokens, peak=True)  # scored eviction: its schedule from the prompt
        return s.batch * (needed * spec.token_nbytes + min(needed, spec.residual or 0) * spec.dense_token_nbytes)
    held = spec.held_nbytes(s.batch, tokens)
    return max(held, spec.max_nbytes(s.batch, tokens)) if hasattr(spec, "max_nbytes") else held  # hf_quantized


def build_tables(
    native: Sequence[Any], options: Mapping[str, Mapping[str, Mapping[str, Any]]], scenario: Scenario
) -> list[LayerTable]:
    """Per cache layer, every option of its kind (`options[kind][name] = entry`) that the layer accepts, with its
    bytes; the native option ({}, named "native") is always there. Options a layer refuses are listed in `skipped`."""
    tables = []
    for p in resolve_plan(native).layers:
        entries = {NATIVE: {}, **{n: dict(e) for n, e in options.get(p.kind, {}).items()}}
        opts, skipped = [], {}
        for name, entry in entries.items():
            try:
                spec = _layer_spec(native, p.address, entry)
            except CacheError as e:  # e.g. kivi's group size does not divide this layer's head_dim
                skipped[name] = str(e)
                continue
            opts.append(Option(name, entry, spec_nbytes(spec, scenario)))
        tables.append(LayerTable(p.address, p.kind, tuple(opts), skipped))
    return tables


def _layer_spec(native: Sequence[Any], address: str, entry: Mapping[str, Any]) -> LayerSpec:
    plan = resolve_plan(native, {"layers": {address: dict(entry)}} if entry else None)
    return next(p.spec for p in plan.layers if p.address == address)


@dataclass(frozen=True)
class Choice:
    """One option per layer (`picks[i]` indexes tables[i].options)."""

    tables: tuple[LayerTable, ...]
    picks: tuple[int, ...]

    @property
    def options(self) -> list[Option]:
        return [t.options[i] for t, i in zip(self.tables, self.picks)]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.options)

    @property
    def cost(self) -> float:
        return sum(o.cost for o in self.options)

    @property
    def names(self) -> dict[str, str]:
        return {t.address: o.name for t, o in zip(self.tables, self.options)}

    @property
    def config(self) -> dict[str, Any]:
        """A cache config for the library: a `layers:` entry for every layer not left native."""
        return {"layers": {t.address: dict(o.entry) for t, o in zip(self.tables, self.options) if o.entry}}


@dataclass(frozen=True)
class Front:
    """Non-dominated allocations, by increasing bytes and strictly decreasing cost."""

    points: tuple[Choice, ...]
    exact: bool

    @property
    def min_nbytes(self) -> int:
        return self.points[0].nbytes

    def best_within(self, budget: int) -> Choice:
        """The cheapest allocation holding at most `budget` bytes (BudgetTooSmall below the smallest one)."""
        if budget < self.min_nbytes:
            raise BudgetTooSmall(budget, self.min_nbytes)
        lo, hi = 0, len(self.points)  # the last point with nbytes <= budget: the front's cost falls with bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.points[mid].nbytes <= budget else (lo, mid)
        return self.points[lo]


def pareto_front(tables: Sequence[LayerTable], max_front: int = 100_000) -> Front:
    """The exact (bytes, cost) Pareto front of one-option-per-layer allocations (sparse DP; the module docstring)."""
    if not tables:
        raise PlannerError("nothing to plan: no cache layers")
    for t in tables:
        if not t.options:
            raise PlannerError(f"layer {t.address} has no usable option (refused: {dict(t.skipped)})")
    front: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    exact = True
    for t in tables:
        merged = sorted(
            (b + o.nbytes, c + o.cost, picks + (j,)) for b, c, picks in front for j, o in enumerate(t.options)
        )
        front = []
        for point in merged:  # by bytes, then cost: keep a point only if it is cheaper than every smaller one
            if not front or point[1] < front[-1][1]:
                front.append(point)
        if len(front) > max_front:
            front, exact = _thin(front, max_front), False
    tables = tuple(tables)
    return Front(tuple(Choice(tables, picks) for _, _, picks in front), exact)


def _thin(front: list, size: int) -> list:
    """At most about `size` points: the smallest, then the cheapest (last) of each byte bucket."""
    lo, hi = front[0][0], front[-1][0]
    width = max(1, -(-(hi - lo) // size))
    kept = [front[0]]
    for i, point in enumerate(front[1:], 1):
        if i == len(front) - 1 or (front[i + 1][0] - lo) // width != (point[0] - lo) // width:
            kept.append(point)
    return kept


def plan_budget(tables: Sequence[LayerTable], budget: int, max_front: int = 100_000) -> Choice:
    """The allocation of least summed cost whose bytes fit `budget` (BudgetTooSmall, naming the minimum, if none)."""
    return pareto_front(tables, max_front).best_within(budget)


def uniform_choices(tables: Sequence[LayerTable]) -> dict[str, Choice]:
    """Every 'same option on every layer of a kind' allocation, named "attention option + recurrent option", for the
    combinations that every layer of each kind accepts."""
    kinds = sorted({t.kind for t in tables})
    names = {k: [o.name for o in next(t for t in tables if t.kind == k).options] for k in kinds}
    combos: list[dict[str, str]] = [{}]
    for k in kinds:
        combos = [
            {**c, k: n} for c in combos for n in names[k] if all(t.option(n) is not None for t in tables if t.kind == k)
        ]
    out = {}
    for combo in combos:
        picks = tuple(next(i for i, o in enumerate(t.options) if o.name == combo[t.kind]) for t in tables)
        out[" + ".join(combo[k] for k in kinds)] = Choice(tuple(tables), picks)
    return out

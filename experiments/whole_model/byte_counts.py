"""A cache's bytes by part: keys/values per native attention type, and recurrent states with the short
convolution's state apart from the SSM / delta-rule / LRU state. Read from our own accounting, never a formula: a
layer's bytes are the planner's peak for a scenario (hybridcache/tools/planner.py `spec_nbytes`, from the resolved spec
of hybridcache/cache/core/plan.py); a recurrent layer's are split by its state layout's codecs (each state's codes,
scales and error-feedback residual) and the split is checked to add up to the spec's own total.

    parts = part_bytes(resolve_plan(native, config), batch=1, tokens=32768)
    # {"kv_full": ..., "state_conv": ..., "state_ssm": ...}; kv_bytes(parts), state_bytes(parts)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hybridcache.cache.core.plan import CachePlan, LayerPlan
from hybridcache.tools.planner import Scenario, spec_nbytes

KV_PREFIX, STATE_PREFIX = "kv_", "state_"
CONV, SSM = "state_conv", "state_ssm"  # the conv inputs kept; the SSM / delta-rule / LRU state itself


class AccountingError(AssertionError):
    """The per-state split of a recurrent layer does not add up to its spec's bytes (the layout changed)."""


def recurrent_parts(spec: Any, batch: int) -> dict[str, int]:
    """A recurrent layer's bytes held between blocks: {state_conv, state_ssm} (every non-conv state is the SSM's)."""
    layout = spec.layout()
    copies = batch * (1 + int(getattr(spec, "rollback", 0)))  # the kept checkpoints hold whole copies
    out = {CONV: 0, SSM: 0}
    for name, (shape, dtype) in layout.shapes.items():
        row = layout.codecs[name].row_nbytes(shape, dtype)
        residual = getattr(layout, "error_codecs", {}).get(name)
        if residual is not None:
            row += residual.row_nbytes(shape, dtype)
        out[CONV if name == "conv" else SSM] += copies * row
    total = spec.min_nbytes(batch, 0)
    if sum(out.values()) != total:
        raise AccountingError(
            f"{type(spec).__name__}: its states add up to {sum(out.values())} bytes, its spec holds {total}"
        )
    return out


def layer_parts(p: LayerPlan, scenario: Scenario) -> dict[str, int]:
    """One cache layer's bytes by part for `scenario` (attention: the planner's peak under its native type)."""
    if p.kind == "recurrent":
        parts = recurrent_parts(p.spec, scenario.batch)
        if sum(parts.values()) != spec_nbytes(p.spec, scenario):
            raise AccountingError(f"layer {p.address}: the planner's bytes differ from its states'")
        return parts
    return {KV_PREFIX + p.native_type: spec_nbytes(p.spec, scenario)}


def part_bytes(plan: CachePlan, batch: int, tokens: int) -> dict[str, int]:
    """The whole cache's bytes by part after a `tokens`-token prompt fed in one block (batch rows): every attention
    native type present and both state parts, each summed over the layers (zero parts kept: a model's table has the
    same columns whatever it holds)."""
    scenario = Scenario(batch, tokens, tokens)
    out: dict[str, int] = {CONV: 0, SSM: 0}
    for p in plan.layers:
        for part, n in layer_parts(p, scenario).items():
            out[part] = out.get(part, 0) + n
    return out


def kv_bytes(parts: Mapping[str, int]) -> int:
    return sum(n for k, n in parts.items() if k.startswith(KV_PREFIX))


def state_bytes(parts: Mapping[str, int]) -> int:
    return sum(n for k, n in parts.items() if k.startswith(STATE_PREFIX))


def kind_bytes(layers: Iterable[Any], nbytes: Any, kind: Any = lambda layer: layer.kind) -> dict[str, int]:
    """{"kv": ..., "state": ...}: `nbytes(layer)` summed over layers by `kind(layer)` (attention / recurrent); for a
    plan's LayerPlans, a Cache's layers or a planner's choices alike."""
    out = {"kv": 0, "state": 0}
    for layer in layers:
        k = kind(layer)
        if k not in ("attention", "recurrent"):
            raise AccountingError(f"a cache layer of kind {k!r}: neither attention (KV) nor recurrent (states)")
        out["kv" if k == "attention" else "state"] += int(nbytes(layer))
    return out


def saving(ours: int, native: int) -> float | None:
    """The share of `native` bytes saved (0.25: a quarter fewer); None where native holds nothing."""
    return 1 - ours / native if native else None

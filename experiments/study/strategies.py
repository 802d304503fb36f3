"""experiment=study's strategies: which named cache configs run, for which probes, under which protocol, and what
each was checked against."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridcache.cache import get_layer_class, resolve_plan

#: The controls (issue 40): each drops one part of the cache, so a strategy's effect on that part can be read against
#: what the model loses without it. Which part a strategy touches is read from its plan (`control_for`).
CONTROLS = {"recurrent": "ablate_state", "ssm": "ablate_ssm", "attention": "ablate_attention"}


def strategy_configs(e: DictConfig) -> dict[str, dict[str, Any]]:
    """Name -> cache config, the baseline strategy first (added as the native `{}` when not listed); with
    `controls` on, the control strategies too (those the model has no layers for are dropped later, by plan)."""
    raw = OmegaConf.to_container(e.strategies, resolve=True) or {}
    only = list(e.only) if e.get("only") else None
    if only is not None and e.get("controls", True):
        only += [c for c in CONTROLS.values() if c in raw and c not in only]
    if only:
        unknown = [n for n in only if n not in raw and n != e.baseline]
        if unknown:
            raise ValueError(f"experiment.only names unknown strategies {unknown} (known: {', '.join(raw)})")
    base = e.baseline
    out = {base: raw.get(base) or {}}
    for name, config in raw.items():
        if name != base and (only is None or name in only):
            out[name] = config or {}
    return out


def control_for(plan, native_plan) -> str | None:
    """The control of a strategy: the ablation of the part of the cache its plan changes: attention, the recurrent
    states without the conv states (a state codec that leaves them dense: ablate_ssm), or all recurrent states;
    None when it changes both kinds or neither."""
    changed = [b for a, b in zip(native_plan.layers, plan.layers) if a != b]
    kinds = {get_layer_class(b.type).kind for b in changed}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind == "recurrent" and not any(getattr(b.spec, "quantize_conv", True) for b in changed):
        return CONTROLS["ssm"]
    return CONTROLS[kind]


def probed(e: DictConfig, section: str, compute: list[str]) -> list[str]:
    """The strategies a costly probe (`passkey`, `ruler`) runs for: its `strategies:` (null: all), the reference
    always."""
    names = e[section].get("strategies")
    if names is None:
        return list(compute)
    unknown = [n for n in names if n not in e.strategies]
    if unknown:
        raise ValueError(f"experiment.{section}.strategies names unknown strategies {unknown}")
    return [n for n in compute if n in set(names) or n == e.baseline]


def plan_or_error(model, config: dict[str, Any]):
    try:
        return resolve_plan(model.native_layers(), config), None
    except Exception as err:  # noqa: BLE001 - an unknown or inapplicable type: the row says why, the study goes on
        return None, f"{type(err).__name__}: {str(err).splitlines()[0]}"


def compresses_after_prefill(plan) -> bool:
    """Whether some cache layer compresses once, at the end of the first block it is fed (`schedule: prefill`, as
    kvpress's presses do). Read from the resolved specs, so a type's own default schedule counts too."""
    return any(getattr(p.spec, "schedule", None) == "prefill" for p in plan.layers)


def references(e: DictConfig, name: str) -> dict[str, Any]:
    """What a strategy was checked against (`experiment.references`), empty when nobody has said."""
    ref = (OmegaConf.to_container(e.references, resolve=True) if e.get("references") else {}).get(name) or {}
    return {"reference": ref.get("reference"), "agreement": ref.get("agreement")}

"""The main run's summary leads with the verdict: the oracle, then what a difference from the reference means, and only
then the agreement it explains (a changed plan's low agreement is its measured effect, said so on its own line)."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf
from rich.console import Console

from experiments.core.report import print_summary, verdict

CFG = OmegaConf.create({"model": {"dtype": "float32"}})
TRACKER = SimpleNamespace(sync_command=None, run_dir=None, error=None)


def plan(*lossy: str):
    layers = [SimpleNamespace(address=a, exact=a not in lossy) for a in ("0", "1", "2")]
    return SimpleNamespace(layers=layers, exact=not lossy)


def summary(changed: list[str], agreement: float, exact: bool = True) -> dict:
    return {
        "plan_exact": exact,
        "plan_changed_layers": changed,
        "oracle_pass": exact,
        "oracle_max_dlogit": 1e-6 if exact else 0.3,
        "oracle_tolerance": 1e-4,
        "agreement": agreement,
        "pass_rate": 1.0,
        "max_abs_dlogprob": 0.5,
        "tokens_per_s/ours": 10.0,
        "cache_bytes/prompt": 0,
        "cache_bytes/tokens": 8,
        "cache_bytes/held": 100,
        "cache_bytes/native": 200,
    }


def printed(the_plan, the_summary) -> list[str]:
    ref = {"name": "hf"}
    lines, _ = verdict(CFG, the_plan, the_summary, ref)
    console = Console(record=True, width=400)
    print_summary(console, "t", [], the_summary, ref, lines, TRACKER, "results.json")
    return [line for line in console.export_text().splitlines() if line.strip()]


def index(lines: list[str], start: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(start))


def test_a_retyped_plan_states_its_verdict_before_its_agreement():
    lines = printed(plan(), summary(["2"], 0.344))
    oracle, meaning, agreement = index(lines, "oracle"), index(lines, "the oracle passes"), index(lines, "agreement")
    assert oracle < meaning < agreement
    assert "by design" in lines[meaning] and "strategy's effect" in lines[meaning]
    assert "34.4% (differs by design" in lines[agreement]


def test_a_lossy_plan_states_its_verdict_before_its_agreement():
    lines = printed(plan("1"), summary(["1"], 0.5, exact=False))
    meaning = index(lines, "this plan differs from the model's native one by design")
    assert index(lines, "oracle: the plan is lossy") < meaning < index(lines, "agreement")
    assert "lossy layers 1" in lines[meaning]


def test_the_native_plan_does_not_claim_a_difference_by_design():
    lines = printed(plan(), summary([], 0.9))
    assert index(lines, "oracle") < index(lines, "the plan is the model's native one") < index(lines, "agreement")
    assert not any("by design" in line for line in lines)

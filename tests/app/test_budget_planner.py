"""The byte-budget planner (hybridcache/tools/planner.py, experiments/study/budget_planner.py): optimal within budget
on random
option tables (against brute force and every uniform choice), and end to end on the tiny Jamba."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hybridcache as hc
from experiments.study.budget_planner import evaluate, measure_costs, run_config
from experiments.study.state_sensitivity import layer_sensitivity
from hybridcache.cache import resolve_plan
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.tools.planner import (
    BudgetTooSmall,
    LayerTable,
    Option,
    PlannerError,
    Scenario,
    build_tables,
    pareto_front,
    plan_budget,
    uniform_choices,
)


@st.composite
def tables_and_budget(draw):
    """1-5 layers of two kinds; every layer of a kind has the same option names (so uniform choices exist)."""
    per_kind = {"attention": draw(st.integers(1, 4)), "recurrent": draw(st.integers(1, 4))}
    tables = []
    for i in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(sorted(per_kind)))
        options = tuple(
            Option(f"{kind[0]}{j}", {"j": j}, draw(st.integers(0, 60)), draw(st.floats(0, 10, allow_nan=False)))
            for j in range(per_kind[kind])
        )
        tables.append(LayerTable(str(i), kind, options))
    return tables, draw(st.integers(0, 300))


def brute_force(tables, budget):
    fits = [c for c in itertools.product(*(t.options for t in tables)) if sum(o.nbytes for o in c) <= budget]
    return min((sum(o.cost for o in c) for c in fits), default=None)


@given(tables_and_budget())
def test_plan_is_optimal_within_budget(case):
    tables, budget = case
    minimum = sum(min(o.nbytes for o in t.options) for t in tables)
    best = brute_force(tables, budget)
    if best is None:
        with pytest.raises(BudgetTooSmall, match=f"smallest configuration the options allow: {minimum} bytes") as e:
            plan_budget(tables, budget)
        assert e.value.minimum == minimum and budget < minimum
        return
    choice = plan_budget(tables, budget)
    assert choice.nbytes <= budget
    assert choice.cost == pytest.approx(best, abs=1e-9)
    for name, uniform in uniform_choices(tables).items():
        if uniform.nbytes <= budget:
            assert choice.cost <= uniform.cost + 1e-9, name
    front = pareto_front(tables)
    assert front.exact and front.min_nbytes == minimum
    assert all(p.nbytes < q.nbytes and p.cost > q.cost for p, q in zip(front.points, front.points[1:]))


@given(tables_and_budget())
def test_a_thinned_front_stays_within_budget(case):
    tables, budget = case
    try:
        choice = plan_budget(tables, budget, max_front=2)
    except BudgetTooSmall:
        assert brute_force(tables, budget) is None
        return
    assert choice.nbytes <= budget


def test_bad_inputs_are_named_errors():
    with pytest.raises(PlannerError, match="no cache layers"):
        pareto_front([])
    with pytest.raises(PlannerError, match="layer 3 has no usable option"):
        pareto_front([LayerTable("3", "attention", ())])
    with pytest.raises(PlannerError, match="prompt_len <= context_len"):
        Scenario(1, 10, 5)


def test_end_to_end_on_tiny_jamba():
    model = hc.from_pretrained(tiny_checkpoint("jamba"))
    ids = torch.randint(3, model.vocab_size, (1, 14), generator=torch.Generator().manual_seed(5))
    prompt = 8
    options = {
        "attention": {
            "sliding4": {"type": "sliding", "window": 4},
            "int4": {"storage": "int4"},
            "snapkv0.5": {"type": "snapkv", "compression_ratio": 0.5, "schedule": "prefill", "window_size": 2},
            "chunked4": {"type": "chunked", "chunk_size": 4},
            "kivi": {"storage": "kivi"},
        },  # group 32 does not divide jamba's head_dim 16
        "recurrent": {"int4": {"state_codec": "int4"}},
    }
    tables = build_tables(model.native_layers(), options, Scenario(1, prompt, ids.shape[1] - 1))
    assert "kivi" in tables[2].skipped and tables[2].option("kivi") is None
    for o in tables[2].options:  # the byte model: the peak between blocks; a chunk's is not at the end of this run
        _, cache = run_config(model, ids, prompt, {"layers": {"2": dict(o.entry)}})
        held = cache.nbytes() - sum(t.options[0].nbytes for t in tables if t.address != "2")
        assert held == o.nbytes if o.name != "chunked4" else held < o.nbytes == 3 * 256, o.name
    tables, rows = measure_costs(model, ids, prompt, tables)
    # recurrent costs are layer_sensitivity's measurement
    ref = {r["layer"]: r["kl"] for r in layer_sensitivity(model, ids, prompt, codecs=("int4",))}
    assert {r["layer"]: r["kl"] for r in rows if r["option"] == "int4" and r["kind"] == "recurrent"} == ref
    front = pareto_front(tables)
    native_bytes = resolve_plan(model.native_layers()).held_nbytes(1, ids.shape[1] - 1)
    assert front.points[-1].nbytes <= native_bytes
    for budget in (front.min_nbytes, (front.min_nbytes + native_bytes) // 2, native_bytes):
        choice = front.best_within(budget)
        resolve_plan(model.native_layers(), choice.config)  # the library accepts it
        logits, cache = run_config(model, ids, prompt, choice.config)
        assert torch.isfinite(logits).all()
        assert cache.nbytes() == choice.nbytes <= budget  # no chunked option: the peak is the end of the run
    rows = evaluate(model, ids, prompt, tables, [front.min_nbytes, native_bytes // 2])
    planned = [r for r in rows if r["kind"] == "planned"]
    assert len(rows) - len(planned) == 5 * 2 and len(planned) == 2  # every uniform (attention x recurrent) option
    for r in planned:
        assert r["held_after_run"] <= r["bytes"] <= r["budget"]
        fits = [u["predicted_cost"] for u in rows if u["kind"] == "uniform" and u["bytes"] <= r["budget"]]
        assert r["predicted_cost"] <= min(fits) + 1e-12
    assert any(r["on_front"] for r in rows)
    with pytest.raises(BudgetTooSmall, match=str(front.min_nbytes)):
        plan_budget(tables, front.min_nbytes - 1)


def test_every_layer_is_measured_beside_its_control(tmp_path):
    """Each (layer, option) row carries the layer's control (its recurrent state dropped after every block, its
    attention limited to the token itself). The shipped trained_hybrid with its SSM readout cut (a model built to
    ignore its SSM states, tests/app/ignored_state.py) gets its Mamba2 layers flagged insensitive and its attention
    layers not; the shipped model itself, whose states carry its context beyond its 8-byte attention window, gets
    no layer flagged (the control there is the independent oracle of what a layer's cache matters: the same stepwise
    feeding with that layer ablated)."""
    from hybridcache.checkpoints.real import real_checkpoint
    from tests.app.ignored_state import cut_ssm_readout

    text = b"The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun. "
    ids = torch.tensor([[b + 3 for b in text]])  # ByT5: byte + 3
    options = {
        "attention": {"sliding4": {"type": "sliding", "window": 4}},
        "recurrent": {"int8": {"state_codec": "int8"}},
    }

    def rows_of(model):
        tables = build_tables(model.native_layers(), options, Scenario(1, 40, ids.shape[1] - 1))
        _, rows = measure_costs(model, ids, 40, tables)
        return {k: [r for r in rows if r["kind"] == k] for k in ("recurrent", "attention")}

    shipped = real_checkpoint("trained_hybrid")
    cut = rows_of(hc.from_pretrained(cut_ssm_readout(shipped, tmp_path / "cut")))
    assert cut["recurrent"] and all(r["insensitive"] and r["control_kl"] < 1e-3 for r in cut["recurrent"])
    assert cut["attention"] and all(not r["insensitive"] for r in cut["attention"])
    real = rows_of(hc.from_pretrained(shipped))
    assert real["recurrent"] and not any(r["insensitive"] for r in real["recurrent"])

"""The budget planner's evaluated plans say what part of the cache they hold (issue 40 item 6): each row's bytes as
keys/values and recurrent states, what the Cache holds after the run split the same way, and the saving on the
whole cache, on the tiny Jamba (attention and Mamba layers)."""

import torch

import hybridcache as hc
from experiments.study.budget_planner import evaluate, render_table
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.tools.planner import Scenario, build_tables


def test_each_plan_splits_its_bytes_and_saves_on_the_whole_cache():
    model = hc.from_pretrained(tiny_checkpoint("jamba"))
    ids = torch.randint(3, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    prompt = 8
    options = {"attention": {"int4": {"storage": "int4"}}, "recurrent": {"int8": {"state_codec": "int8"}}}
    tables = build_tables(model.native_layers(), options, Scenario(1, prompt, ids.shape[1] - 1))
    native = {
        "kv": sum(t.options[0].nbytes for t in tables if t.kind == "attention"),
        "state": sum(t.options[0].nbytes for t in tables if t.kind == "recurrent"),
    }
    assert native["kv"] > 0 and native["state"] > 0
    rows = {r["config"]: r for r in evaluate(model, ids, prompt, tables, [])}
    for r in rows.values():
        assert r["kv_bytes"] + r["state_bytes"] == r["bytes"], r["config"]
        assert r["held_after_run_kv"] + r["held_after_run_state"] == r["held_after_run"], r["config"]
        assert r["saving"] == 1 - r["bytes"] / (native["kv"] + native["state"])
    assert (rows["uniform native + native"]["kv_bytes"], rows["uniform native + native"]["state_bytes"]) == (
        native["kv"],
        native["state"],
    )
    states = rows["uniform native + int8"]  # a state-only plan: KV bytes as native's, held and planned
    assert states["kv_bytes"] == native["kv"] and states["held_after_run_kv"] == native["kv"]
    assert 0 < states["state_bytes"] < native["state"] and states["saving"] > 0
    kv = rows["uniform int4 + native"]
    assert kv["state_bytes"] == native["state"] and kv["held_after_run_state"] == native["state"]
    assert 0 < kv["kv_bytes"] < native["kv"]
    text = str(render_table(list(rows.values()), "t").columns[2].header)
    assert text == "KV / states" and render_table(list(rows.values()), "t").row_count == len(rows)

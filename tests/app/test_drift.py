"""experiment=drift: the smoke run end to end (run.py, ~64 tokens on the shipped trained hybrid), its measurement
against an independent recompute (state_sensitivity's teacher-forced stepwise logits, KL written here), and its
settings refused by name before any work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import hybridcache as hc
from experiments.core.common import UserError
from experiments.drift.main import settings
from experiments.drift.measure import measure_drift, parse_variant, smooth, summarize, variant_config, windows_of
from experiments.study.state_sensitivity import stepwise_logits
from hybridcache.checkpoints.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BASE = OmegaConf.load(ROOT / "configs/experiment/drift.yaml")


def run_drift(tmp_path, *overrides, code=0):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "run.py", "experiment=drift", *overrides, f"hydra.run.dir={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_drift_smoke_writes_numbers_curves_and_a_figure(tmp_path):
    out, proc = run_drift(tmp_path, "model=trained_hybrid", "experiment.smoke=true")
    data = json.loads((out / "drift.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["int8", "int8+sr+ef", "int4+ef:bfloat16", "ablate_ssm", "ablate_state"]
    assert data["settings"]["decode_tokens"] == 64 and len(data["per_position"]["int8"]["kl"]) == 64
    for r in rows.values():
        assert [(w["start"], w["end"]) for w in r["windows"]] == [(0, 16), (16, 32), (32, 64)]
        assert all(w["kl_mean"] >= 0 and 0 <= w["top1"] <= 1 for w in r["windows"]) and r["seconds"] > 0
    # the residual is counted: int8 + a float32 residual holds more than int8 alone, int4 + bfloat16 in between
    assert rows["int8"]["state_bytes_per_row"] < rows["int4+ef:bfloat16"]["state_bytes_per_row"]
    assert rows["int4+ef:bfloat16"]["state_bytes_per_row"] < rows["int8+sr+ef"]["state_bytes_per_row"]
    assert rows["ablate_state"]["state_bytes_per_row"] == 0 < rows["ablate_ssm"]["state_bytes_per_row"]
    assert rows["int8+sr+ef"]["cache_config"]["recurrent"] == {
        "state_codec": "int8",
        "rounding": "stochastic",
        "rounding_seed": 0,
        "error_feedback": True,
    }
    # dropping every state is what this model cannot take: its control is far above the codecs
    assert rows["ablate_state"]["kl_mean"] > 100 * rows["int8"]["kl_mean"]
    assert (out / "drift.png").stat().st_size > 10_000 and "wall time" in proc.stdout


@pytest.mark.parametrize("feed", ["greedy", "text"])
def test_measurement_equals_an_independent_recompute(feed):
    """Per position, KL(native || int4+sr+ef) and top-1 agreement equal those computed from two separate
    teacher-forced runs over the tokens fed (the prompt in one block, then one token per block); greedy: those tokens
    are the native run's greedy choices; text: they are the given text."""
    model = hc.from_pretrained(tiny_checkpoint("bamba"))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.vocab_size, (2, 5), generator=g)
    text = torch.randint(0, model.vocab_size, (2, 12), generator=g) if feed == "text" else None
    variant = parse_variant("int4+sr+ef", seed=3)
    config = variant_config(None, variant)
    record = measure_drift(model, prompts, 12, {variant.name: config}, text=text)
    ids = torch.cat([prompts, record.tokens], 1)  # [B, 5 + 12]
    native = stepwise_logits(model, ids, 5).log_softmax(-1)[:, :12]  # [B, 12, V]: predicting token p
    lossy = stepwise_logits(model, ids, 5, config).log_softmax(-1)[:, :12]
    assert torch.equal(native.argmax(-1) if text is None else text, record.tokens)
    kl = (native.exp() * (native - lossy)).sum(-1).clamp(min=0).double().T  # [12, B]
    assert torch.allclose(record.kl[variant.name], kl, rtol=1e-6, atol=1e-12) and float(kl.max()) > 0
    assert torch.equal(record.top1[variant.name], (lossy.argmax(-1) == native.argmax(-1)).T)
    summary = summarize(record, windows_of([[0, 4], [4, 100]], 12))[variant.name]
    assert summary["windows"][1]["end"] == 12
    assert summary["windows"][0]["kl_mean"] == pytest.approx(float(kl[:4].mean()))
    x, means = smooth(kl[:, 0], 4)
    assert means.numel() == 9 and float(means[0]) == pytest.approx(float(kl[:4, 0].mean())) and float(x[0]) == 1.5


@pytest.mark.parametrize(
    "override,message",
    [
        ({"variants": ["int3"]}, "'int3'.*not a lossy state codec"),
        ({"variants": ["dense"]}, "not a lossy state codec"),
        ({"variants": ["int8+sr+sr"]}, r"'\+sr' is not one of"),
        ({"variants": ["int8+sr:int4"]}, r"'\+sr:int4' is not one of"),
        ({"variants": ["int8", "int8"]}, "twice"),
        ({"variants": ["ablate_ssm"], "controls": []}, "under experiment.controls"),
        ({"controls": ["bfloat16"]}, "controls must be among"),
        ({"variants": [], "controls": []}, "nothing to measure"),
        ({"decode_tokens": 0}, "decode_tokens must be a positive integer"),
        ({"rows": True}, "rows must be a positive integer"),
        ({"windows": [[5, 5]]}, r"each window is \[start, end\)"),
        ({"windows": []}, "windows must be a list"),
        ({"seed": -1}, "seed must be an integer"),
        ({"smoke": "yes"}, "smoke must be true or false"),
        ({"feed": "sampled"}, "feed must be greedy or text"),
    ],
)
def test_bad_settings_are_named(override, message):
    e = OmegaConf.merge(OmegaConf.create({k: v for k, v in BASE.items() if k != "defaults"}), override)
    with pytest.raises(UserError, match=message):
        settings(e)


def test_bad_cache_values_and_models_without_states_are_refused_before_loading(tmp_path):
    _, proc = run_drift(tmp_path, "model=trained_hybrid", "experiment.variants=[int8+ef:int3]", code=2)
    assert "experiment.variants: 'int8+ef:int3'" in proc.stderr and "unknown state_codec 'int3'" in proc.stderr
    _, proc = run_drift(tmp_path, "model=gemma3", code=2)
    assert "no recurrent layers" in proc.stderr

"""experiment=long_context end to end on a tiny random Gemma3 (CI's smoke setting), its worker process, and its
settings checks.

No quality assertions (random weights): what must hold for any model. Every (strategy, length) group ran in its own
process and reported its peak RSS; each prompt was prefilled in chunks (a compress-after-prefill strategy in one
block); identical prompts ran once; a strategy with the baseline's plan (a state codec on a model without states)
was not rerun; the heatmap was drawn; with `reference_scoring` every answer was scored again by the given code and
the agreement counted (here a stand-in that scores 42 everywhere, so none agree: the count is real).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.long_context import ruler
from experiments.long_context.main import LongContextSettingError, check_settings

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """
def always_42(preds, refs):
    return 42.0

TASKS = {kind: {'metric_fn': always_42} for kind in
         ('niah', 'variable_tracking', 'common_words_extraction', 'freq_words_extraction', 'qa')}
"""
EVALUATE = """
import nemo  # never imported: only postprocess_pred is compiled


def postprocess_pred(predict_str: str, task_config: dict):
    return predict_str.strip()
"""


def stand_in_checkout(root: Path) -> Path:
    (root / "scripts/eval/synthetic").mkdir(parents=True)
    (root / "scripts/eval/synthetic/constants.py").write_text(STAND_IN)
    (root / "scripts/eval/evaluate.py").write_text(EVALUATE)
    return root


def test_long_context_smoke(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "experiment=long_context",
            "model=gemma3",
            "experiment.smoke=true",
            f"experiment.reference_scoring={stand_in_checkout(tmp_path / 'ruler')}",
            f"hydra.run.dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "long_context.json").read_text())
    assert data["random_weights"] is True
    rows = {r["name"]: r for r in data["strategies"]}
    assert set(rows) == {"native", "snapkv_50", "state_int8"}
    assert rows["state_int8"]["same_plan"] is True and "trials" not in rows["state_int8"]
    for name, chunk in (("native", 256), ("snapkv_50", "whole prompt")):
        r = rows[name]
        assert set(r["groups"]) == {"1000", "1800"}
        for g in r["groups"].values():
            assert g["chunk"] == chunk and 0 < g["loaded_rss_mib"] <= g["peak_rss_mib"] and g["cache_bytes"] > 0
        # ruler: niah_single_1 at 1800 (depth 0.5) and vt at 1800; niah grid: niah_single_1 at 2 depths x 2 lengths
        cells = sorted((t["task"], t["length"], t["depth"]) for t in r["trials"])
        assert cells == sorted(
            [("niah_single_1", 1800, 0.5), ("vt", 1800, None)]
            + [("niah_single_1", L, d) for L in (1000, 1800) for d in (0.0, 1.0)]
        )
        for t in r["trials"]:
            assert t["score"] == ruler.score(t["task"], t["prediction"], t["answers"])
            assert t["reference_score"] == 42.0 and t["max_new_tokens"] == 4 and t["seconds"] > 0
        assert set(r["niah"]) == {"0.0", "1.0"} and all(set(v) == {"1000", "1800"} for v in r["niah"].values())
        assert set(r["ruler"]) == {"niah_single_1", "vt"}
    # the snapkv prompt of 1800 tokens in one block holds its attention weights: more memory than chunks of 256
    assert rows["snapkv_50"]["groups"]["1800"]["peak_rss_mib"] > rows["native"]["groups"]["1800"]["peak_rss_mib"]
    assert data["reference_agreement"] == {"samples": 12, "equal": 0}
    assert Path(data["plot"]).is_file()
    assert "Peak RSS" in result.stdout and "0/12 answers scored the same" in result.stdout


def test_the_worker_answers_as_generate_does_and_reports_its_peak_rss(tmp_path):
    """The worker's greedy tokens after a chunked prefill are generate's, in this process, with the same settings."""
    import hybridcache as hc
    from hybridcache.checkpoints.tiny import tiny_checkpoint

    os.environ.setdefault("HYBRIDCACHE_HOME", str(tmp_path / "home"))
    checkpoint = str(tiny_checkpoint("gemma3", seed=0))
    prompts = [
        {"ids": [5 + (i * 7) % 200 for i in range(300)], "max_new_tokens": 6},
        {"ids": [9] * 40, "max_new_tokens": 3},
    ]
    job = {"checkpoint": checkpoint, "config": {"attention": {"storage": "int8"}}, "chunk": 64, "threads": 1}
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**job, "prompts": prompts}))
    out = subprocess.run(
        [sys.executable, "-m", "experiments.long_context.probe", "--job", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert "loaded_rss_mib" in lines[0] and lines[-1]["peak_rss_mib"] >= lines[0]["loaded_rss_mib"] > 0
    answers = lines[1:-1]
    model = hc.from_pretrained(checkpoint)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor([prompt["ids"]])
        expected = hc.generate(
            model, ids, max_new_tokens=prompt["max_new_tokens"], cache_config=job["config"], prefill_chunk_size=64
        )
        assert answer["tokens"] == expected.sequences[0, ids.shape[1] :].tolist()


def compose_experiment(*overrides):
    import experiments  # noqa: F401 - registers the schemas

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=["experiment=long_context", *overrides]).experiment


def test_the_paper_setting_composes_with_the_studys_strategies():
    e = compose_experiment()
    assert e.name == "long_context" and list(e.ruler.lengths) == [4096, 8192, 16384]
    assert len(e.ruler.tasks) == 11 and list(e.niah.lengths) == [1024, 2048, 4096, 8192, 16384]
    assert {"native", "snapkv_50", "int4", "tova_256", "all_local_512"} <= set(e.strategies)
    assert e.strategies.ablate_attention.attention.chunk_size == e.chunk == 1024  # the control sees one chunk
    check_settings(e)


@pytest.mark.parametrize(
    "override, message",
    [
        ("experiment.chunk=-1", "experiment.chunk"),
        ("experiment.ruler.lengths=[4096,0]", "ruler.lengths"),
        ("experiment.niah.depths=[0.5,1.5]", "niah.depths"),
        ("experiment.ruler.tasks=[niah_single_1,qa_1]", "unknown tasks"),
        ("experiment.niah.task=vt", "needle task"),
        ("experiment.niah.max_new_tokens=0", "niah.max_new_tokens"),
        ("experiment.ruler.trials=-2", "ruler.trials"),
    ],
)
def test_bad_settings_are_named_before_any_work(override, message):
    with pytest.raises(LongContextSettingError, match=message):
        check_settings(compose_experiment(override))


def test_heatmap_cells_from_every_trial_of_a_task(tmp_path):
    """A strategy run only in the RULER part still gets a panel: its cells come from the task's trials."""
    from experiments.long_context.report import grid_of, niah_heatmaps

    def trial(task, length, depth, score, part="ruler"):
        return {"task": task, "length": length, "depth": depth, "score": score, "parts": [part]}

    run = {
        "name": "int4",
        "trials": [
            trial("niah_single_2", 4096, 0.5, 100.0),
            trial("niah_single_2", 4096, 0.5, 0.0, "niah"),
            trial("niah_single_2", 8192, 0.5, 0.0),
            trial("niah_single_1", 4096, 0.5, 100.0),
            trial("vt", 4096, None, 100.0),
        ],
    }
    assert grid_of(run, "niah_single_2") == {"0.5": {"4096": 50.0, "8192": 0.0}}
    assert niah_heatmaps([run], tmp_path / "a.png", "t") is None  # no heatmap part
    assert niah_heatmaps([run], tmp_path / "b.png", "t", "niah_single_2").is_file()

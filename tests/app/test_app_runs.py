"""run.py in-process (fast; lets a test break W&B or count model loads): errors before loading, exit statuses,
W&B failures that lose nothing, verdict wording, numbers that agree, sweeps with a summary, unique run directories."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "prompts.texts=[hi there,a much longer prompt that is clearly the longest of the three,mid prompt]",
    "max_new_tokens=4",
    "reference=none",
]


@pytest.fixture
def app(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Run `python run.py ARGS` in this process: returns (exit status, results.json or None, stdout, stderr)."""
    import experiments
    import run

    home = tmp_path_factory.getbasetemp() / "hybridcache-home"  # tiny checkpoints, built once per session
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "unused"))  # restored after the test (the Tracker sets them)
    monkeypatch.chdir(ROOT)

    def call(*args, out=None, multirun=False):
        out = out or tmp_path / "out"
        GlobalHydra.instance().clear()
        experiments.EXIT.code = 0
        where = f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"
        monkeypatch.setattr(sys, "argv", ["run.py", *(["-m"] if multirun else []), *args, where])
        capsys.readouterr()
        run.main()
        captured = capsys.readouterr()
        path = out / "results.json"
        results = json.loads(path.read_text()) if path.exists() else None
        return experiments.EXIT.code, results, captured.out, captured.err

    return call


def no_model_load(monkeypatch):
    import experiments.correctness.main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(experiments.correctness.main, "load_model", refuse)


@pytest.mark.parametrize(
    "args,message",
    [
        (["cache.attention.type=slidng"], "unknown cache type 'slidng'"),
        (["cache.full.chunk_size=0", "cache=hybrid_chunked"], "chunk_size must be a positive integer"),
        (["max_new_tokens=0"], "max_new_tokens must be a positive integer, got 0"),
        (["top_k=-1"], "top_k must be a positive integer"),
        (["reference=file"], "reference=file needs reference.path="),
        (
            ["reference=file", "reference.path=/nonexistent/refs.jsonl"],
            "reference file /nonexistent/refs.jsonl does not exist",
        ),
        (["reference=vllm", "reference.python=null"], "reference=vllm needs reference.python="),
        (["reference=vllm", "reference.python=/no/such/python"], "is not an interpreter on this machine"),
        (["reference=llamacpp"], "reference=llamacpp times the same GGUF in llama.cpp for experiment=benchmark only"),
        (["model.device=nodevice"], "model.device=nodevice is not a device torch knows"),
        (
            ["model.device=cuda:0"] if not __import__("torch").cuda.is_available() else ["model.device=cuda:99"],
            "model.device=cuda",
        ),
        (["model.dtype=float8"], "model.dtype=float8 is not one of"),
        (["model.checkpoint=/no/such/checkpoint"], "checkpoint directory '/no/such/checkpoint' does not exist"),
        (["cache.plugins=[no_such_plugin_module]"], "cache plugin 'no_such_plugin_module' could not be imported"),
        (["cache.attention.window=-3"], "cache.attention.window must be a positive integer, got -3"),  # even unused
        (["cache.recurrent.state_dtype=int32"], "cache.recurrent.state_dtype=int32 is not a floating-point dtype"),
        (["+cache.layers.2.chunk_size=0"], "cache.layers.2.chunk_size must be a positive integer, got 0"),
        (["model.weights=int4"], "model.weights=int4 is not one of null, bfloat16, int8"),
        (["model.weights=int8", "model.dtype=float64"], "model.weights=int8 packs the projections of a float32 model"),
    ],
)
def test_user_errors_are_one_line_before_the_model_loads(app, monkeypatch, args, message):
    no_model_load(monkeypatch)
    code, results, out, err = app("model=jamba", *args)
    assert code == 2
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in out + err
    assert results["status"] == "error" and message in results["error"]


def test_wandb_init_failure_loses_nothing(app, monkeypatch):
    import wandb

    def broken(*a, **k):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", broken)
    code, results, out, _ = app("model=mamba2", "logger.mode=online", *SHORT)
    assert code == 0 and results["status"] == "ok" and results["summary"]["oracle_pass"]
    assert "W&B: wandb.init failed (UsageError: api_key not configured" in out
    assert results["wandb"]["dir"] is None


def test_wandb_logging_failure_loses_nothing(app, monkeypatch):
    import wandb

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(wandb, "Table", broken)
    code, results, out, _ = app("model=mamba2", *SHORT)
    assert code == 0 and results["status"] == "ok" and results["generations"]["ours"]
    assert "logging table prompts failed (RuntimeError: disk full)" in out
    assert results["wandb"]["error"].startswith("logging table prompts failed")


def test_wandb_stays_in_the_output_dir_and_captures_the_console(app, tmp_path, monkeypatch):
    home = tmp_path / "user-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    code, results, out, _ = app("model=mamba2", *SHORT)
    assert code == 0
    run_dir = Path(results["wandb"]["dir"])
    assert run_dir.is_relative_to(tmp_path / "out") and run_dir.is_dir()
    assert not [p for p in home.rglob("*") if "wandb" in p.name], list(home.rglob("*"))
    assert not (tmp_path / "unused").exists()
    assert f"upload: wandb sync {run_dir}" in out.replace("\n", "")
    console_log = (tmp_path / "out" / "console.log").read_text()
    assert "oracle (cached == recompute, same strategy): passes" in console_log
    assert (run_dir / "files" / "console.log").exists()


def test_oracle_failure_on_an_exact_plan_exits_non_zero(app):
    code, results, out, _ = app("model=jamba", "oracle_tolerance=1e-12", *SHORT)
    assert code == 1 and results["exit_code"] == 1 and results["status"] == "oracle_failed"
    assert results["summary"]["plan_exact"] and not results["summary"]["oracle_pass"]
    assert "the cache is wrong (a bug)" in out


def test_oracle_tolerance_follows_the_dtype(app):
    code, results, out, _ = app("model=gemma3", "model.dtype=bfloat16", *SHORT)
    assert code == 0 and results["summary"]["oracle_tolerance"] == 0.25 and results["summary"]["oracle_pass"]
    assert "a bug" not in out


def test_lossy_plan_is_not_called_a_bug(app):
    code, results, out, _ = app("model=jamba", "cache.attention.type=full", "cache.attention.storage=int8", *SHORT)
    assert code == 0 and results["status"] == "ok"
    assert not results["summary"]["plan_exact"]
    assert "the plan is lossy (layers 2)" in out and "a bug" not in out.replace("not a bug", "")


def test_preset_that_changes_nothing_says_so(app):
    code, results, out, _ = app("model=mamba", "cache=hybrid_sliding", *SHORT)
    assert code == 0 and results["summary"]["plan_changes_nothing"]
    assert results["summary"]["plan_changed_layers"] == []
    assert "cache=hybrid_sliding changes no layer of mamba" in out
    assert "changes no layer" in results["plan_note"]


def test_cache_plugin_module_from_the_command_line(app, tmp_path, monkeypatch):
    (tmp_path / "hc_app_plugin_b.py").write_text(
        "from hybridcache.cache import SlidingWindowLayer, register_cache_layer\n\n\n"
        "@register_cache_layer('app_plugin_window_b')\nclass PluginWindow(SlidingWindowLayer):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, results, out, _ = app(
        "model=jamba",
        "cache.plugins=[hc_app_plugin_b]",
        "cache.full.type=app_plugin_window_b",
        "cache.full.window=8",
        *SHORT,
    )
    assert code == 0, out
    assert [r["type"] for r in results["plan"]][2] == "app_plugin_window_b"
    assert results["summary"]["oracle_pass"]


def test_numbers_longest_prompt_plan_and_labels(app):
    code, results, out, _ = app("model=jamba", "cache=hybrid_chunked", "cache.full.chunk_size=8", *SHORT)
    s = results["summary"]
    # the longest prompt is the second one, not the last
    lengths = [r["prompt_tokens"] for r in results["prompts"]]
    assert s["cache_bytes/prompt"] == 1 == lengths.index(max(lengths))
    assert s["cache_bytes/tokens"] == max(lengths) + 4 - 1
    # the summary's bytes are the plan's bytes (the table printed above it), to the byte
    assert s["cache_bytes/held"] == s["cache_bytes/plan"] == sum(r["bytes"] for r in results["plan"])
    assert "warmup_s/ours" in s and "new tokens/s (batch 1, each prompt's prefill included" in out
    assert f"cache bytes held for the longest prompt (prompt 2 of 3, {s['cache_bytes/tokens']} tokens)" in out
    assert "random tiny jamba checkpoint (seed 0, untrained)" in out and results["random_weights"]
    assert "jamba · cache=hybrid_chunked · reference=none · cache.full.chunk_size=8" in out


def test_native_vs_native_bytes_are_equal(app):
    code, results, _, _ = app("model=gemma3", "cache=native", *SHORT)
    assert results["summary"]["cache_bytes/held"] == results["summary"]["cache_bytes/native"]


def test_nothing_agreed_prints_na():
    from hybridcache.reference import Generation
    from hybridcache.tools.compare import compare_generations

    a = Generation([1], [5, 6], [-0.1, -0.2], [{5: -0.1, 7: -1.0}, {6: -0.2}])
    b = Generation([1], [7, 6], [-0.3, -0.2], [{7: -0.3, 5: -1.2}, {6: -0.2}])
    c = compare_generations(a, b)
    assert c.agreed == 0 and c.max_abs_dlogprob is None


def test_own_recording_replayed_is_worded_as_such(app, tmp_path):
    record = tmp_path / "ours.jsonl"
    code, _, _, _ = app("model=jamba", "cache=hybrid_chunked", *SHORT, f"+record={record}", out=tmp_path / "a")
    assert code == 0 and json.loads(record.read_text().splitlines()[0])["meta"]["source"] == "hybridcache"
    short = [a for a in SHORT if a != "reference=none"]
    code, results, out, _ = app(
        "model=jamba", "cache=native", *short, "reference=file", f"reference.path={record}", out=tmp_path / "b"
    )
    assert code == 0 and results["reference"]["source"] == "hybridcache" and not results["reference"]["same_plan"]
    assert "our own recording (cache=hybrid_chunked)" in out
    assert "strategy's effect" not in out
    # another dtype is refused, naming it
    code, _, _, err = app(
        "model=jamba", "model.dtype=float64", *short, "reference=file", f"reference.path={record}", out=tmp_path / "c"
    )
    assert code == 2 and "dtype 'float32'" in err


def test_sweep_prints_a_summary_and_titles_differ(app, tmp_path):
    code, _, out, _ = app("model=jamba", "cache=native,hybrid_chunked", *SHORT, multirun=True, out=tmp_path / "sweep")
    assert code == 0
    rows = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    assert [r["run"] for r in rows] == ["0", "1"] and all(r["status"] == "ok" for r in rows)
    assert rows[0]["overrides"] != rows[1]["overrides"]
    titles = [json.loads((tmp_path / "sweep" / r / "results.json").read_text())["title"] for r in ("0", "1")]
    assert len(set(titles)) == 2
    assert f"sweep sweep-{tmp_path.name}-sweep: 2 runs" in out.replace("\n", "")
    from experiments.core.report import common_overrides

    shared = common_overrides(rows)  # said once, in the table's title
    assert {"model=jamba", "max_new_tokens=4", "reference=none"} < set(shared) and len(shared) == 4
    assert not any(o.startswith("cache=") for o in shared)
    assert "every run: model=jamba" in out


def test_sweep_with_a_failing_run_exits_non_zero(app, tmp_path):
    code, _, out, _ = app(
        "model=jamba", "max_new_tokens=0,2", *SHORT[:1], "reference=none", multirun=True, out=tmp_path / "sweep"
    )
    rows = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["error", "ok"] and code == 2
    assert "1 of 2 runs failed" in out


def test_duplicate_runs_of_a_sweep_are_flagged(app, tmp_path):
    code, _, out, _ = app(
        "model=jamba", "cache=native", "cache.attention.chunk_size=16,64", *SHORT, multirun=True, out=tmp_path / "sweep"
    )
    rows = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    assert rows[1]["same_as"] == "0"


def test_runs_started_together_get_different_directories():
    cmd = [sys.executable, "run.py", "--cfg", "hydra", "--resolve"]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    dirs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        lines = out.splitlines()
        run_i = lines.index("  run:")
        dirs.append(lines[run_i + 1].split("dir:")[1].strip())
    assert len(set(dirs)) == 3, dirs


def test_console_uses_the_terminal_width(monkeypatch):
    from experiments.core.common import make_console

    monkeypatch.setenv("COLUMNS", "90")
    assert make_console().width == 90


def test_readme_sweep_example_has_no_duplicate_runs():
    import re

    from hydra import compose, initialize_config_dir

    from experiments.core.common import cache_config_from_hydra
    from hybridcache.cache import resolve_plan
    from hybridcache.checkpoints.tiny import tiny_config
    from hybridcache.models import model_class

    page = (ROOT / "docs" / "app.md").read_text()  # the sweep example the README's app section moved to
    section = page[page.index("**Sweeps.**") :]
    command = re.search(r"`python run\.py -m ([^`]*)`", section).group(1).split()
    axes = [(a.split("=")[0], a.split("=")[1].split(",")) for a in command]
    import itertools

    seen = set()
    for values in itertools.product(*(v for _, v in axes)):
        overrides = [f"{k}={v}" for (k, _), v in zip(axes, values)]
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        config = tiny_config(cfg.model.family).to_dict()
        native = model_class(config["model_type"])(config).native_layers()
        plan = resolve_plan(native, cache_config_from_hydra(cfg.cache)[0])
        key = (cfg.model.family, tuple((p.type, p.spec) for p in plan.layers))
        assert key not in seen, f"{overrides} repeats an earlier combination"
        seen.add(key)


def test_titles_name_the_model_config_not_its_family(app, monkeypatch):
    no_model_load(monkeypatch)
    code, results, _, _ = app("model=jamba20m", "max_new_tokens=0")
    assert code == 2 and results["title"].startswith("jamba20m · cache=native · reference=hf")


def test_recurrent_state_dtype_from_the_command_line(app):
    """The documented `cache.recurrent.state_dtype` field: a dtype name becomes the library's torch dtype."""
    code, results, out, err = app("model=mamba2", "cache.recurrent.state_dtype=float64", *SHORT)
    assert code == 0 and results["status"] == "ok", err
    assert {p["state_dtype"] for p in results["plan"]} == {"float64"}


def test_results_json_exists_even_when_a_check_crashes(app, monkeypatch, tmp_path):
    """A bug before the model loads (here in the settings checks) still leaves a results.json saying so."""
    import experiments.correctness.main

    def crash(cfg):
        raise RuntimeError("a bug in the checks")

    monkeypatch.setattr(experiments.correctness.main, "preflight", crash)
    with pytest.raises(SystemExit):  # Hydra reports the traceback and exits 1
        app("model=jamba", *SHORT)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["status"] == "crashed" and results["error"] == "RuntimeError: a bug in the checks"
    assert results["exit_code"] == 1 and "model=jamba" in results["overrides"]


def test_plan_bytes_in_results_are_for_what_the_longest_prompt_held(app, monkeypatch):
    """A row that stops early (eos) holds fewer tokens than prompt + max_new_tokens - 1: results.json's plan bytes
    are computed for what it held, so they still add up to the summary's bytes."""
    import experiments.correctness.main as correctness

    generate = correctness._generate_ours

    def stops_early(model, prompt, cfg, prep, max_new_tokens=None):
        longest = max(len(p) for p in prep.prompts)
        return generate(model, prompt, cfg, prep, max_new_tokens or (2 if len(prompt) == longest else None))

    monkeypatch.setattr(correctness, "_generate_ours", stops_early)
    code, results, _, _ = app("model=jamba", "cache=hybrid_chunked", "cache.full.chunk_size=8", *SHORT)
    s = results["summary"]
    assert code == 0 and s["cache_bytes/tokens"] == max(r["prompt_tokens"] for r in results["prompts"]) + 2 - 1
    assert s["cache_bytes/held"] == s["cache_bytes/plan"] == sum(r["bytes"] for r in results["plan"])


def test_packed_weights_run_with_the_oracle_and_say_so(app):
    """model.weights=int8: another model (it diverges from HF's float32), but cached == recompute still holds."""
    code, results, out, _ = app("model=gemma3", "model.weights=int8", "reference=hf", *SHORT[:2])
    assert code == 0 and results["summary"]["oracle_pass"]
    assert results["config"]["model"]["weights"] == "int8"

"""The Hydra app: every model x cache preset composes into a plan; bad overrides fail clearly; real runs of run.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.core.common import cache_config_from_hydra
from hybridcache.cache import CacheConfigError, resolve_plan
from hybridcache.cache.core.plan import flatten_native
from hybridcache.checkpoints.tiny import FAMILIES, tiny_config
from hybridcache.models import model_class

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ["native", "hybrid", "full", "static", "hybrid_sliding", "hybrid_chunked"]


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def native_layers(family):
    config = tiny_config(family).to_dict()
    return model_class(config["model_type"])(config).native_layers()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_and_preset_composes_into_a_plan(family, preset):
    cfg = compose_cfg(f"model={family}", f"cache={preset}", "cache.full.chunk_size=16")
    cache_config, preallocate = cache_config_from_hydra(cfg.cache)
    native = native_layers(family)
    plan = resolve_plan(native, cache_config, 128 if preallocate else None)
    assert [p.native_type for p in plan.layers] == [n.type for _, _, n in flatten_native(native)]
    attention = [p for p in plan.layers if p.kind == "attention"]
    assert bool(attention) == (family not in ("mamba", "mamba2"))
    native_plan = resolve_plan(native)
    expected = {"hybrid_sliding": "sliding", "hybrid_chunked": "chunked"}.get(preset)
    for p, q in zip(plan.layers, native_plan.layers):
        if preset == "full" and p.kind == "attention":
            assert p.type == "full"
        elif expected and p.native_type == "full":  # hybrid_* presets change only natively full layers
            assert p.type == expected
        else:  # natively sliding / chunked layers keep their own window / chunk (gemma3's window stays native)
            assert p.type == q.type
            if preset != "static":
                assert p.spec == q.spec
    if preset == "hybrid_chunked":
        assert {p.spec.chunk_size for p in plan.layers if p.native_type == "full"} <= {16}
    if preset == "static" and attention:
        assert {p.spec.max_length for p in attention} == {128}
    recurrent = [p for p in plan.layers if p.kind == "recurrent"]
    assert all(p.type == p.native_type for p in recurrent)


def test_hybrid_sliding_keeps_gemma3_native_sliding_windows():
    """Before: every attention layer became sliding(64), so gemma3's window-8 layers silently got window 64."""
    native = native_layers("gemma3")
    natively_sliding = [i for i, n in enumerate(native) if n.type == "sliding"]
    assert natively_sliding and any(n.type == "full" for n in native)
    plan = resolve_plan(native, cache_config_from_hydra(compose_cfg("model=gemma3", "cache=hybrid_sliding").cache)[0])
    native_plan = resolve_plan(native)
    for i in natively_sliding:
        assert plan[i].spec.window == native_plan[i].spec.window != 64
    assert {plan[i].spec.window for i, n in enumerate(native) if n.type == "full"} == {64}
    assert plan.changed(native_plan) == [str(i) for i, n in enumerate(native) if n.type == "full"]
    # every attention layer, natively sliding ones included, on request
    everything = compose_cfg(
        "model=gemma3", "cache=native", "cache.attention.type=sliding", "cache.attention.window=32"
    )
    plan = resolve_plan(native, cache_config_from_hydra(everything.cache)[0])
    assert {p.spec.window for p in plan.layers} == {32}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_has_every_documented_field(preset):
    """One schema: any documented field can be overridden on any preset without `+`."""
    fields = [
        "cache.attention.type=sink",
        "cache.attention.window=16",
        "cache.attention.chunk_size=8",
        "cache.attention.sinks=4",
        "cache.attention.storage=int8",
        "cache.full.type=sliding",
        "cache.full.window=16",
        "cache.full.storage=int8",
        "cache.sliding.window=4",
        "cache.chunked.chunk_size=8",
        "cache.recurrent.state_dtype=float32",
        "cache.preallocate=true",
        "cache.plugins=[]",
    ]
    cfg = compose_cfg("model=gemma3", f"cache={preset}", *fields)
    assert cfg.cache.attention.sinks == 4 and cfg.cache.full.storage == "int8" and cfg.cache.layers == {}
    plan = resolve_plan(native_layers("gemma3"), cache_config_from_hydra(cfg.cache)[0], 256)
    # most specific wins: natively full layers follow full.*, the others attention.*
    assert {p.type for p in plan.layers if p.native_type == "full"} == {"sliding"}
    assert {p.type for p in plan.layers if p.native_type == "sliding"} == {"sink"}
    assert {p.spec.window for p in plan.layers if p.native_type == "full"} == {16}
    assert not plan.exact  # int8 storage is lossy


def test_ignored_fields_are_reported():
    from experiments.core.common import cache_config_with_notes

    cfg = compose_cfg("model=jamba", "cache=native", "cache.attention.window=16")
    config, _, notes = cache_config_with_notes(cfg.cache)
    assert "attention" not in config
    assert notes == [
        "cache.attention.window=16 has no effect: cache.attention.type is not set (set it to apply "
        "window to every attention layer)"
    ]


PLUGIN = """
from hybridcache.cache import SlidingWindowLayer, register_cache_layer


@register_cache_layer("{name}")
class AppPluginWindow(SlidingWindowLayer):
    pass
"""


def test_cache_plugins_load_user_modules(tmp_path, monkeypatch):
    (tmp_path / "hc_app_plugin_a.py").write_text(PLUGIN.format(name="app_plugin_window_a"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_cfg(
        "model=jamba",
        "cache=native",
        "cache.plugins=[hc_app_plugin_a]",
        "+cache.layers.2.type=app_plugin_window_a",
        "+cache.layers.2.window=5",
    )
    config, _ = cache_config_from_hydra(cfg.cache)
    assert config["plugins"] == ["hc_app_plugin_a"]
    plan = resolve_plan(native_layers("jamba"), config)
    assert plan[2].type == "app_plugin_window_a" and plan[2].spec.window == 5


def test_layer_override_from_the_command_line():
    cfg = compose_cfg("model=jamba", "cache=hybrid_chunked", "+cache.layers.2.type=sliding", "+cache.layers.2.window=5")
    plan = resolve_plan(native_layers("jamba"), cache_config_from_hydra(cfg.cache)[0])
    assert plan[2].type == "sliding" and plan[2].spec.window == 5


@pytest.mark.parametrize(
    "override,message",
    [
        ("cache.attention.type=slidng", "unknown cache type 'slidng'"),
        ("cache.full.chunk_size=0", "chunk_size must be a positive integer, got 0"),
        ("+cache.layers.0.type=full", "layer 0 is a recurrent layer"),
        ("+cache.layers.99.type=full", "layers.99: layer index out of range"),
        ("+cache.full.chunksize=3", "unknown parameter for cache type 'chunked'"),
    ],
)
def test_invalid_overrides_fail_naming_the_field(override, message):
    cfg = compose_cfg("model=jamba", "cache=hybrid_chunked", override)
    with pytest.raises(CacheConfigError, match=message):
        resolve_plan(native_layers("jamba"), cache_config_from_hydra(cfg.cache)[0])


def test_unknown_group_option_fails_at_compose():
    with pytest.raises(Exception, match="nope"):
        compose_cfg("cache=nope")


def run_app(tmp_path, *overrides, timeout=600, code=0, env=None):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home"), **(env or {})}
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "run.py", *overrides, f"hydra.run.dir={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    if code:
        return None, result
    results = json.loads((out / "results.json").read_text())
    assert results["wandb"]["dir"] and Path(results["wandb"]["dir"]).is_dir()
    assert "offline-run" in results["wandb"]["dir"]
    assert str(out / "results.json") in result.stdout.replace("\n", "")
    return results, result


def test_main_command_jamba_hybrid_chunked(tmp_path):
    results, proc = run_app(tmp_path, "model=jamba", "cache=hybrid_chunked")
    stdout = proc.stdout
    assert results["summary"]["oracle_pass"] and results["exit_code"] == 0
    assert {r["type"] for r in results["plan"]} == {"mamba", "chunked"}
    assert "oracle (cached == recompute, same strategy): passes" in stdout
    assert "random tiny jamba checkpoint" in stdout
    assert "cache=hybrid_chunked changes 1 of 4 cache layers: 2 (full→chunked)" in stdout
    # no noise: no progress bars or library warnings, a real sync command, no placeholder
    noise = ("Writing model shards", "it/s]", "Warning", "warn(", "DIR")
    assert not [n for n in noise if n in stdout + proc.stderr], (stdout + proc.stderr)[-3000:]
    assert f"wandb sync {results['wandb']['dir']}" in stdout.replace("\n", "")


def test_gemma3_native_matches_hf_completely(tmp_path):
    results, _ = run_app(tmp_path, "model=gemma3", "cache=native", "reference=hf")
    assert results["summary"]["oracle_pass"]
    assert results["summary"]["agreement"] == 1.0 and results["summary"]["pass_rate"] == 1.0
    assert all(r["first_divergence"] is None for r in results["prompts"])
    # native vs native: the bytes held are the native plan's, to the byte
    assert results["summary"]["cache_bytes/held"] == results["summary"]["cache_bytes/native"]


def test_record_then_replay_from_file(tmp_path):
    record = tmp_path / "ref.jsonl"
    short = ["prompts.texts=[hello world,a slightly longer prompt that crosses windows]", "max_new_tokens=8"]
    first, _ = run_app(tmp_path / "a", "model=mamba2", *short, f"+record={record}")
    lines = record.read_text().splitlines()
    meta = json.loads(lines[0])["meta"]
    assert len(lines) == 2 and meta["source"] == "hf" and meta["model_type"] == "mamba2" and meta["weights"]
    again, _ = run_app(tmp_path / "b", "model=mamba2", *short, "reference=file", f"reference.path={record}")
    assert again["summary"]["agreement"] == 1.0
    assert [g["tokens"] for g in again["generations"]["reference"]] == [
        g["tokens"] for g in first["generations"]["reference"]
    ]
    # a mamba2 recording replayed on jamba is refused before any model is loaded, in one line
    _, proc = run_app(tmp_path / "c", "model=jamba", *short, "reference=file", f"reference.path={record}", code=2)
    assert "was recorded with model type 'mamba2'" in proc.stderr and "Traceback" not in proc.stderr


VLLM_PYTHON = os.environ.get("HYBRIDCACHE_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="set HYBRIDCACHE_VLLM_PYTHON to a vLLM environment's python (README)")
def test_vllm_reference_on_mamba2(tmp_path):
    results, _ = run_app(tmp_path, "model=mamba2", "reference=vllm", "max_new_tokens=16", timeout=1200)
    assert results["summary"]["oracle_pass"]
    assert results["summary"]["pass_rate"] == 1.0


@pytest.mark.skipif(not VLLM_PYTHON, reason="set HYBRIDCACHE_VLLM_PYTHON to a vLLM environment's python (README)")
def test_vllm_refuses_mamba1_on_cpu_clearly(tmp_path):
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "run.py", "model=mamba", "reference=vllm", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode != 0 and "no Mamba1 kernel" in result.stderr + result.stdout

"""The Hydra app: every model x cache preset composes into a plan; bad overrides fail clearly; real runs of run.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.common import cache_config_from_hydra
from hybridcache.cache import CacheConfigError, resolve_plan
from hybridcache.models import model_class
from hybridcache.tiny_models import FAMILIES, tiny_config

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
    cfg = compose_cfg(f"model={family}", f"cache={preset}", "cache.attention.chunk_size=16")
    cache_config, preallocate = cache_config_from_hydra(cfg.cache)
    native = native_layers(family)
    plan = resolve_plan(native, cache_config, 128 if preallocate else None)
    assert [p.native_type for p in plan.layers] == [n.type for n in native]
    attention = [p for p in plan.layers if p.kind == "attention"]
    assert bool(attention) == (family not in ("mamba", "mamba2"))
    expected = {"full": "full", "hybrid_sliding": "sliding", "hybrid_chunked": "chunked"}.get(preset)
    if expected and attention:
        assert {p.type for p in attention} == {expected}
    elif not expected:
        assert all(p.type == p.native_type for p in plan.layers)
    if preset == "hybrid_chunked" and attention:
        assert {p.spec.chunk_size for p in attention} == {16}
    if preset == "static" and attention:
        assert {p.spec.max_length for p in attention} == {128}
    recurrent = [p for p in plan.layers if p.kind == "recurrent"]
    assert all(p.type == p.native_type for p in recurrent)


def test_layer_override_from_the_command_line():
    cfg = compose_cfg("model=jamba", "cache=hybrid_chunked", "+cache.layers.2.type=sliding", "+cache.layers.2.window=5")
    plan = resolve_plan(native_layers("jamba"), cache_config_from_hydra(cfg.cache)[0])
    assert plan[2].type == "sliding" and plan[2].spec.window == 5


@pytest.mark.parametrize("override,message", [
    ("cache.attention.type=slidng", "unknown cache type 'slidng'"),
    ("cache.attention.chunk_size=0", "chunk_size must be a positive integer, got 0"),
    ("+cache.layers.0.type=full", "layer 0 is a recurrent layer"),
    ("+cache.layers.99.type=full", "layers.99: layer index out of range"),
    ("+cache.attention.chunksize=3", "unknown parameter for cache type 'chunked'"),
])
def test_invalid_overrides_fail_naming_the_field(override, message):
    cfg = compose_cfg("model=jamba", "cache=hybrid_chunked", override)
    with pytest.raises(CacheConfigError, match=message):
        resolve_plan(native_layers("jamba"), cache_config_from_hydra(cfg.cache)[0])


def test_unknown_group_option_fails_at_compose():
    with pytest.raises(Exception, match="nope"):
        compose_cfg("cache=nope")


def run_app(tmp_path, *overrides, timeout=600):
    env = {**os.environ, "WANDB_MODE": "offline", "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={out}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["wandb_dir"] and Path(results["wandb_dir"]).is_dir()
    assert "offline-run" in results["wandb_dir"]
    assert str(out / "results.json") in result.stdout.replace("\n", "")
    return results, result.stdout


def test_main_command_jamba_hybrid_chunked(tmp_path):
    results, stdout = run_app(tmp_path, "model=jamba", "cache=hybrid_chunked")
    assert results["summary"]["oracle_pass"]
    assert {r["type"] for r in results["plan"]} == {"mamba", "chunked"}
    assert "oracle (cached == use_cache=False, same strategy): passes" in stdout


def test_gemma3_native_matches_hf_completely(tmp_path):
    results, _ = run_app(tmp_path, "model=gemma3", "cache=native", "reference=hf")
    assert results["summary"]["oracle_pass"]
    assert results["summary"]["agreement"] == 1.0 and results["summary"]["pass_rate"] == 1.0
    assert all(r["first_divergence"] is None for r in results["prompts"])


def test_record_then_replay_from_file(tmp_path):
    record = tmp_path / "ref.jsonl"
    short = ["prompts.texts=[hello world,a slightly longer prompt that crosses windows]", "max_new_tokens=8"]
    first, _ = run_app(tmp_path / "a", "model=mamba2", *short, f"+record={record}")
    lines = record.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["meta"]["source"] == "hf"
    again, _ = run_app(tmp_path / "b", "model=mamba2", *short, "reference=file", f"reference.path={record}")
    assert again["summary"]["agreement"] == 1.0
    assert [g["tokens"] for g in again["generations"]["reference"]] == [g["tokens"] for g in first["generations"]["reference"]]


VLLM_PYTHON = os.environ.get("HYBRIDCACHE_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="set HYBRIDCACHE_VLLM_PYTHON to a vLLM environment's python (README)")
def test_vllm_reference_on_mamba2(tmp_path):
    results, _ = run_app(tmp_path, "model=mamba2", "reference=vllm", "max_new_tokens=16", timeout=1200)
    assert results["summary"]["oracle_pass"]
    assert results["summary"]["pass_rate"] == 1.0


@pytest.mark.skipif(not VLLM_PYTHON, reason="set HYBRIDCACHE_VLLM_PYTHON to a vLLM environment's python (README)")
def test_vllm_refuses_mamba1_on_cpu_clearly(tmp_path):
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "run.py", "model=mamba", "reference=vllm", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode != 0 and "no Mamba1 kernel" in result.stderr + result.stdout

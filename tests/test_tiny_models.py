"""Tests for hybridcache.checkpoints.tiny (tiny random HF checkpoints, CPU, offline)."""

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, ByT5Tokenizer

try:
    tm = importlib.import_module("hybridcache.checkpoints.tiny")
except ImportError:  # package __init__ not importable (yet): load the module by path
    _path = Path(__file__).resolve().parents[1] / "hybridcache" / "checkpoints/tiny.py"
    _spec = importlib.util.spec_from_file_location("hybridcache_tiny_models", _path)
    tm = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(tm)

EXPECTED_CLASS = {
    "jamba": "JambaForCausalLM",
    "mamba": "MambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "recurrentgemma": "RecurrentGemmaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "zamba": "ZambaForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "bailing_hybrid": "BailingHybridForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "glm5_next": "Glm5NextForConditionalGeneration",
}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path / "hc_home"))


def test_families():
    assert tm.FAMILIES[:6] == ("jamba", "mamba", "mamba2", "recurrentgemma", "gemma3", "llama4")  # + newer ones
    assert set(EXPECTED_CLASS) == set(tm.FAMILIES)


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_config_fits_byt5(family):
    cfg = tm.tiny_config(family)
    tok = ByT5Tokenizer()
    assert cfg.vocab_size == len(tok) == 384
    assert (cfg.pad_token_id, cfg.eos_token_id) == (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert cfg.hidden_size <= 64


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_build_reload_generate(family, tmp_path):
    path = tm.build_tiny_checkpoint(family, tmp_path / family)
    assert path == tmp_path / family
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == EXPECTED_CLASS[family]
    assert model.dtype == torch.float32
    tok = ByT5Tokenizer()
    ids = tok("Hybrid caches!", return_tensors="pt").input_ids[:, :-1]  # drop </s>
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.isfinite(logits).all()
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 16
    assert len(set(new)) > 1, f"degenerate greedy output {new}"


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_seed_determinism(family, tmp_path):
    a = tm.build_tiny_checkpoint(family, tmp_path / "a", seed=0)
    b = tm.build_tiny_checkpoint(family, tmp_path / "b", seed=0)
    c = tm.build_tiny_checkpoint(family, tmp_path / "c", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_build_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    tm.build_tiny_checkpoint("mamba", tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_checkpoint_reuses_directory(tmp_path, monkeypatch):
    p1 = tm.tiny_checkpoint("mamba2")
    root = tmp_path / "hc_home" / "tiny"
    assert p1.parent == root and p1.name.startswith("mamba2-seed0-")
    assert (p1 / "model.safetensors").is_file()
    assert [d.name for d in root.iterdir()] == [p1.name]  # no temp dirs left behind
    stamp = (p1 / "model.safetensors").stat().st_mtime_ns

    def _no_rebuild(*args, **kwargs):
        raise AssertionError("checkpoint was rebuilt")

    monkeypatch.setattr(tm, "build_tiny_checkpoint", _no_rebuild)
    assert tm.tiny_checkpoint("mamba2") == p1
    assert (p1 / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.undo()

    p2 = tm.tiny_checkpoint("mamba2", seed=1)
    assert p2 != p1 and p2.name.startswith("mamba2-seed1-")
    p3 = tm.tiny_checkpoint("mamba2", root=tmp_path / "explicit")
    assert p3.parent == tmp_path / "explicit" and p3.name == p1.name
    assert (p3 / "model.safetensors").read_bytes() == (p1 / "model.safetensors").read_bytes()


def test_unknown_family(tmp_path):
    for call in (
        lambda: tm.tiny_config("gpt2"),
        lambda: tm.build_tiny_checkpoint("gpt2", tmp_path / "x"),
        lambda: tm.tiny_checkpoint("gpt2"),
    ):
        with pytest.raises(ValueError) as err:
            call()
        assert all(f in str(err.value) for f in tm.FAMILIES)


def test_overrides():
    cfg = tm.tiny_config(
        "gemma3", sliding_window=4, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]
    )
    assert cfg.sliding_window == 4 and cfg.num_hidden_layers == 2


def test_gemma3_config():
    cfg = tm.tiny_config("gemma3")
    assert cfg.model_type == "gemma3_text"
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    assert cfg.sliding_window < 16
    assert cfg.query_pre_attn_scalar is not None


def test_llama4_config():
    cfg = tm.tiny_config("llama4")
    assert cfg.model_type == "llama4_text"
    assert cfg.attention_chunk_size < 16
    assert 0 in cfg.no_rope_layers and 1 in cfg.no_rope_layers  # NoPE and RoPE layers
    assert {"chunked_attention", "full_attention"} <= set(cfg.layer_types)
    moe = [i in cfg.moe_layers for i in range(cfg.num_hidden_layers)]
    assert any(moe) and not all(moe)


def test_jamba_config():
    cfg = tm.tiny_config("jamba")
    assert {"attention", "mamba"} == set(cfg.layers_block_type)
    experts = cfg.layers_num_experts
    assert cfg.num_experts in experts and 1 in experts  # MoE and dense MLP layers
    assert cfg.num_experts_per_tok == 2


def test_recurrentgemma_and_mamba2_configs():
    rg = tm.tiny_config("recurrentgemma")
    kinds = (list(rg.block_types) * rg.num_hidden_layers)[: rg.num_hidden_layers]
    assert {"recurrent", "attention"} <= set(kinds)
    assert rg.attention_window_size < 16
    m2 = tm.tiny_config("mamba2")
    assert m2.chunk_size < 16 and m2.n_groups in (1, 2)
    assert m2.num_heads * m2.head_dim == m2.expand * m2.hidden_size

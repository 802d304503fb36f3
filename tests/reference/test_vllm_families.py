"""What vLLM can run, checked before anything is generated: one test per refusal and per family's engine arguments,
on the tiny checkpoints' own config.json files. No vLLM needed (the platform is given, never probed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridcache.checkpoints.tiny import FAMILIES, build_tiny_checkpoint, tiny_checkpoint
from hybridcache.reference import vllm_families as vf
from hybridcache.reference.vllm_families import VLLMIncompatible, vllm_engine_args

ROOT = Path(__file__).resolve().parents[2]
NO_PREFIX = {"enable_prefix_caching": False}

# family -> (tiny size, dtype, engine arguments the family adds on vLLM-CPU); measured to agree with HF on every token
# (tests/reference/test_vllm_live.py runs them when HYBRIDCACHE_VLLM_PYTHON is set).
RUNS_ON_CPU = {
    "mamba2": ("tiny", "float32", NO_PREFIX),
    "gemma3": ("tiny", "float32", {}),
    "gemma4": ("tiny", "float32", {}),  # KV sharing, PLE, experts: every token agrees (2.6e-6)
    "llama4": ("vllm", "float32", {"block_size": 32}),
    "falcon_h1": ("tiny", "float32", NO_PREFIX),
    "granitemoehybrid": ("tiny", "float32", NO_PREFIX),
    "nemotron_h": ("tiny", "float32", NO_PREFIX),
    "zamba2": ("tiny", "float32", NO_PREFIX),
    "lfm2": ("vllm", "float32", {}),
    "qwen3_next": ("tiny", "bfloat16", {}),
    "granite_swa": ("vllm", "float32", {}),
    "gpt_oss": ("vllm", "float32", {}),
}
# family -> what the refusal of its tiny default says on vLLM-CPU (float32)
REFUSED_ON_CPU = {
    "kimi_linear": "cannot configure an engine for KimiLinearForCausalLM",
    "bailing_hybrid": "no BailingHybridForCausalLM",
    "mamba": "no Mamba1 kernel",
    "jamba": "no Mamba1 kernel",
    "bamba": "dropped BambaForCausalLM after v0.23.0",
    "recurrentgemma": "no RecurrentGemma",
    "llama4": r"attention_chunk_size=8 is not a multiple of 32.*model.size=vllm",
    "lfm2": r"always ties its LM head.*model.size=vllm",
    "qwen3_next": r"only in bfloat16.*model.dtype=bfloat16",
    "qwen3_5": "needs torchvision",
    "lfm3": "no Lfm3ForCausalLM",
    "granite_swa": "no kernel for head size 16",
    "gpt_oss": r"swiglu_limit=1.5.*always clamps at 7.0.*model.size=vllm",
    "zamba": "no ZambaForCausalLM",
    "olmo_hybrid": "through triton kernels only",
    "glm5_next": "GLM-5-Next .* does not import on CPU",
}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_families_home")


def config_of(home, family, size="tiny", **overrides):
    if overrides:
        path = build_tiny_checkpoint(family, home / f"{family}-{'-'.join(overrides)}", **overrides)
    else:
        path = tiny_checkpoint(family, root=home, size=size)
    return json.loads((path / "config.json").read_text())


def test_every_family_is_placed():
    assert set(RUNS_ON_CPU) | set(REFUSED_ON_CPU) == set(FAMILIES)
    assert {vf.FAMILIES[t].name for t in vf.FAMILIES} >= set(FAMILIES)


@pytest.mark.parametrize("family", sorted(RUNS_ON_CPU))
def test_engine_args_of_each_family_that_runs(home, family):
    size, dtype, expected = RUNS_ON_CPU[family]
    config = config_of(home, family, size)
    assert vllm_engine_args(config, dtype, {"gpu_memory_utilization": 0.3}, "cpu") == {
        "gpu_memory_utilization": 0.3,
        **expected,
    }


@pytest.mark.parametrize("family", sorted(REFUSED_ON_CPU))
def test_refusal_of_each_tiny_default(home, family):
    with pytest.raises(VLLMIncompatible, match=REFUSED_ON_CPU[family]):
        vllm_engine_args(config_of(home, family), "float32", {}, "cpu")


def test_head_size_refused(home):
    config = config_of(home, "gemma3", head_dim=16)
    with pytest.raises(VLLMIncompatible, match=r"no kernel for head size 16 \(model=gemma3; it takes 32, 64"):
        vllm_engine_args(config, "float32", {}, "cpu")
    assert vllm_engine_args(config, "float32", {}, "gpu") == {}  # the CPU backend's limit only
    zamba = {**config_of(home, "zamba2"), "attention_head_dim": 16}
    with pytest.raises(VLLMIncompatible, match="head size 16"):
        vllm_engine_args(zamba, "float32", {}, "cpu")


def test_dtype_refusals(home):
    gemma = config_of(home, "gemma3")
    with pytest.raises(VLLMIncompatible, match="computes float16 models in bfloat16"):
        vllm_engine_args(gemma, "float16", {}, "cpu")
    with pytest.raises(VLLMIncompatible, match="vLLM has no float64"):
        vllm_engine_args(gemma, "float64", {}, "cpu")
    qwen = config_of(home, "qwen3_next")
    assert vllm_engine_args(qwen, "float32", {}, "gpu") == {}
    with pytest.raises(
        VLLMIncompatible,
        match=r"Gated DeltaNet needs linear key and value head dims of 64 "
        r"\(this checkpoint: \[32, 64\]\)",
    ):
        vllm_engine_args({**qwen, "linear_key_head_dim": 32}, "bfloat16", {}, "cpu")


def test_mamba1_refused_on_cpu_only(home):
    for family in ("mamba", "jamba"):
        config = config_of(home, family)
        with pytest.raises(VLLMIncompatible, match="reference=hf, or a GPU vLLM environment"):
            vllm_engine_args(config, "bfloat16", {}, "cpu")
        vllm_engine_args(config, "float32", {}, "gpu")


def test_bamba_refused_unless_the_vllm_predates_its_removal(home, monkeypatch):
    config = config_of(home, "bamba")
    for platform in ("cpu", "gpu"):
        with pytest.raises(VLLMIncompatible, match="after v0.23.0"):
            vllm_engine_args(config, "float32", {}, platform)
    monkeypatch.setattr(vf, "vllm_installed", lambda python: ("vllm", "0.23.0"))
    assert vllm_engine_args(config, "float32", {}, "gpu", python="/old/vllm/python") == {}
    monkeypatch.setattr(vf, "vllm_installed", lambda python: ("vllm", "0.24.1+cu129"))
    with pytest.raises(VLLMIncompatible, match="after v0.23.0"):
        vllm_engine_args(config, "float32", {}, "gpu", python="/new/vllm/python")


def test_platform_and_version_from_the_distribution(monkeypatch):
    for installed, platform in (
        (("vllm-cpu", "0.32.0"), "cpu"),
        (("vllm", "0.11.0+cpu"), "cpu"),
        (("vllm", "0.32.0"), "gpu"),
    ):
        monkeypatch.setattr(vf, "vllm_installed", lambda python, i=installed: i)
        assert vf.vllm_platform("python") == platform
    assert vf._version("0.23.0") == (0, 23, 0) and vf._version("0.24.1+cu129") == (0, 24, 1)
    assert vf._version("0.10.1rc1") == (0, 10, 1)


def test_required_engine_argument_cannot_be_overridden(home):
    with pytest.raises(VLLMIncompatible, match=r"needs reference.engine_args.enable_prefix_caching=False .*got True"):
        vllm_engine_args(config_of(home, "mamba2"), "float32", {"enable_prefix_caching": True}, "cpu")
    assert vllm_engine_args(config_of(home, "mamba2"), "float32", {}, "gpu") == {}  # the CPU path's need only


def test_nemotron_h_moe_refused_on_cpu(home):
    config = config_of(home, "nemotron_h")
    assert "moe" not in config["layers_block_type"]  # the tiny default runs on vLLM-CPU
    moe = {**config, "layers_block_type": ["linear_attention", "full_attention", "moe"]}
    legacy = {k: v for k, v in config.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M*E"}
    for c in (moe, legacy):
        with pytest.raises(VLLMIncompatible, match=r"non-gated \(relu2\) activation"):
            vllm_engine_args(c, "float32", {}, "cpu")
        assert vllm_engine_args(c, "float32", {}, "gpu") == {}


def test_llama4_chunk_and_block_size(home):
    default, chunk32 = config_of(home, "llama4"), config_of(home, "llama4", "vllm")
    assert default["attention_chunk_size"] == 8 and chunk32["attention_chunk_size"] == 32
    assert vllm_engine_args({**chunk32, "attention_chunk_size": 96}, "float32", {}, "cpu") == {"block_size": 96}
    assert vllm_engine_args({**chunk32, "attention_chunk_size": 8192}, "float32", {}, "cpu") == {}  # 128 divides it
    assert vllm_engine_args(chunk32, "float32", {"block_size": 32}, "cpu") == {"block_size": 32}
    with pytest.raises(VLLMIncompatible, match=r"not a multiple of the KV block size 64"):
        vllm_engine_args(chunk32, "float32", {"block_size": 64}, "cpu")
    with pytest.raises(VLLMIncompatible, match=r"KV blocks of a multiple of 32 tokens; .*block_size=16 is not one"):
        vllm_engine_args(chunk32, "float32", {"block_size": 16}, "cpu")
    with pytest.raises(VLLMIncompatible, match="chunk_size=8 is not a multiple of 16, the smallest KV block size vLLM"):
        vllm_engine_args(default, "float32", {}, "gpu")
    assert vllm_engine_args({**default, "attention_chunk_size": 48}, "float32", {}, "gpu") == {}


def test_llama4_moe_layers_as_vllm_reads_them(home):
    config = config_of(home, "llama4", "vllm")
    assert config["interleave_moe_layer_step"] == 2 and config["moe_layers"] == [1, 3]
    step1 = {**config, "interleave_moe_layer_step": 1}  # HF reads moe_layers, vLLM the step: pass the step that fits
    assert vllm_engine_args(step1, "float32", {}, "cpu") == {
        "hf_overrides": {"interleave_moe_layer_step": 2},
        "block_size": 32,
    }
    with pytest.raises(VLLMIncompatible, match=r"moe_layers=\[0, 3\].*no step gives \[0, 3\]"):
        vllm_engine_args({**config, "moe_layers": [0, 3]}, "float32", {}, "cpu")


def test_lfm2_fields_vllm_reads(home):
    config = config_of(home, "lfm2", "vllm")
    assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]
    bare = {k: v for k, v in config.items() if k not in ("conv_dim", "block_dim")}  # as transformers writes it
    assert vllm_engine_args(bare, "float32", {}, "cpu") == {"hf_overrides": {"conv_dim": 64, "block_dim": 64}}
    with pytest.raises(VLLMIncompatible, match="conv_dim=32, but HF's LFM2 uses hidden_size=64"):
        vllm_engine_args({**config, "conv_dim": 32}, "float32", {}, "cpu")
    with pytest.raises(VLLMIncompatible, match="always ties its LM head"):
        vllm_engine_args({**config, "tie_word_embeddings": False}, "float32", {}, "gpu")


def test_unknown_family_is_left_to_vllm():
    assert vllm_engine_args({"model_type": "llama", "head_dim": 16}, "float32", {"x": 1}, "cpu") == {"x": 1}


# The app: a refusal is one line with exit status 2, before any model is loaded or anything generated. The platform
# is given (reference.platform=cpu) and reference.python is this interpreter, which has no vLLM: had the worker
# started, the run would have failed differently.
APP_REFUSALS = [
    (["model=mamba"], "no Mamba1 kernel"),
    (["model=bamba"], "dropped BambaForCausalLM"),
    (["model=recurrentgemma"], "no RecurrentGemma"),
    (["model=qwen3_next"], "add model.dtype=bfloat16"),
    (["model=nemotron_h", "+reference.engine_args.enable_prefix_caching=true"], "enable_prefix_caching=False"),
]


@pytest.mark.parametrize("overrides,message", APP_REFUSALS, ids=[o[0][6:] for o, _ in APP_REFUSALS])
def test_app_refuses_before_generating(tmp_path, overrides, message):
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    env.pop("HYBRIDCACHE_VLLM_PYTHON", None)
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            *overrides,
            "reference=vllm",
            f"reference.python={sys.executable}",
            "reference.platform=cpu",
            "logger.mode=disabled",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "agreement with" not in proc.stdout and "cache plan" not in proc.stdout


@pytest.mark.parametrize("family,used", [("llama4", True), ("lfm2", True), ("gemma3", False), ("mamba2", False)])
def test_app_uses_the_vllm_variant_where_the_default_differs_on_purpose(tmp_path, family, used):
    """`python run.py model=llama4 reference=vllm` works: the tiny default's vLLM variant is used (and said);
    the variant's config passes the preflight that refuses the plain tiny default."""
    from hydra import compose, initialize_config_dir

    from experiments.core.common import checkpoint_path, use_vllm_variant

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={family}", "reference=vllm", f"home={tmp_path}"])
        hf = compose(config_name="config", overrides=[f"model={family}", "reference=hf"])
    assert use_vllm_variant(cfg) is used and use_vllm_variant(hf) is False
    assert cfg.model.size == ("vllm" if used else "tiny") and hf.model.size == "tiny"
    config = json.loads((Path(checkpoint_path(cfg.model, str(tmp_path))) / "config.json").read_text())
    vllm_engine_args(config, "float32", {}, "cpu")  # refused for the plain tiny llama4 / lfm2 (above)


def test_a_failing_reference_is_one_line_with_exit_status_3(tmp_path):
    """The family passes the preflight, but the interpreter has no vLLM: the worker's failure is reported as one
    line (its root cause), exit status 3, results.json says so; no traceback."""
    env = {**os.environ, "HYBRIDCACHE_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "model=gemma3",
            "reference=vllm",
            f"reference.python={sys.executable}",
            "reference.platform=cpu",
            "logger.mode=disabled",
            "max_new_tokens=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the vllm reference failed" in proc.stderr and "vllm is not importable" in proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["exit_code"] == 3 and "vllm is not importable" in result["error"]

"""Tiny random-weight Hugging Face checkpoints for tests and CLI defaults.

Every family in ``FAMILIES`` is covered, each configured so that every
cache-relevant code path of the family is exercised (attention + SSM layers,
sliding windows, chunked attention, no-RoPE layers, MoE + dense MLPs ...) while
staying small enough to build, load and generate with in well under a second on
CPU. Attention head sizes are 64 where the family takes a head_dim (vLLM-CPU's
attention has no kernel below 32), so vLLM can serve as a reference; the
``vllm`` variant (``SIZES``) covers what the defaults keep different on purpose.

All configs use ``vocab_size=384`` so that they fit the offline, byte-level
``transformers.ByT5Tokenizer()`` (pad=0, eos=1, unk=2, no bos); the tokenizer
files are saved next to the weights so that ``AutoTokenizer.from_pretrained``
works on the checkpoint directory.  Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from hybridcache.paths import home_dir

FAMILIES = (
    "jamba",
    "mamba",
    "mamba2",
    "recurrentgemma",
    "gemma3",
    "llama4",
    "bamba",
    "falcon_h1",
    "zamba2",
    "lfm2",
    "qwen3_next",
    "nemotron_h",
    "granitemoehybrid",
)

#: Bump when the weight re-initialisation scheme changes (invalidates caches).
INIT_VERSION = 1

# Untied LM heads: with tied embeddings a tiny random model mostly predicts its
# own input token (e_t . e_t dominates the logits), so greedy decoding repeats it.
_COMMON = dict(vocab_size=384, pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)

_FAMILY_SPECS = {
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=4,
            attn_layer_offset=2,  # layers: M M A M
            expert_layer_period=2,
            expert_layer_offset=1,  # MoE at 1, 3; dense at 0, 2
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            max_position_embeddings=1024,
        ),
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(hidden_size=64, state_size=8, num_hidden_layers=3, expand=2, conv_kernel=4, time_step_rank=8),
    ),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            hidden_size=64,
            state_size=16,
            num_hidden_layers=3,
            expand=2,
            num_heads=8,
            head_dim=16,
            n_groups=2,
            chunk_size=8,
            conv_kernel=4,
            time_step_rank=8,
        ),
    ),
    "recurrentgemma": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=64,
            block_types=["recurrent", "recurrent", "attention"],  # r r a r
            attention_window_size=8,
            conv1d_width=4,
            logits_soft_cap=30.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # vLLM-CPU's attention: head dim >= 32
            query_pre_attn_scalar=64,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=1024,
        ),
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=1,  # vLLM-CPU's attention: head dim >= 32
            interleave_moe_layer_step=2,
            moe_layers=[1, 3],  # MoE at 1, 3; dense at 0, 2 (vLLM reads the step only)
            no_rope_layers=[1, 1, 1, 0],  # 0 = NoPE layer (full attention)
            attention_chunk_size=8,  # RoPE layers: chunked attention
            max_position_embeddings=1024,
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,  # every layer: attention + Mamba2
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            mamba_d_ssm=96,
            mamba_n_heads=6,
            mamba_d_head=16,
            mamba_n_groups=2,  # d_ssm != expand * hidden
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            max_position_embeddings=1024,
            # MuP multipliers (folded into the weights at load): not 1 and not powers of 2
            embedding_multiplier=1.5,
            lm_head_multiplier=0.75,
            mlp_multipliers=[0.8, 1.25],
            key_multiplier=1.3,
            attention_in_multiplier=0.9,
            attention_out_multiplier=1.1,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.85,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        ),
    ),
    # Tied embeddings as in the real checkpoints: HF ties the shared blocks only when tie_word_embeddings is true.
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            tie_word_embeddings=True,
            layers_block_type=[
                "linear_attention",
                "hybrid",
                "linear_attention",  # M H M H H M: 3 uses of
                "hybrid",
                "hybrid",
                "linear_attention",
            ],  # 2 shared blocks (0, 1, 0)
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            num_attention_heads=2,  # attention head_dim 2 * 64 / 2 = 64
            n_mamba_heads=8,
            mamba_ngroups=2,
            mamba_d_state=16,
            chunk_size=8,
            max_position_embeddings=1024,
            # HF clamps dt at time_step_min in multi-token forwards only, not in decode steps: keep the clamp out of
            # reach (dt_bias is initialised >= log(time_step_floor)); tests/models/test_zamba2_extra.py covers it
            time_step_min=1e-9,
        ),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,  # rotary on the first 32 dims
            attn_layer_indices=[2],  # layers: M M A M
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            max_position_embeddings=1024,
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=256,
            block_multiple_of=64,  # feed-forward width 192
            num_hidden_layers=4,
            num_attention_heads=1,
            num_key_value_heads=1,  # head_dim = hidden / heads = 64
            layer_types=["conv", "conv", "full_attention", "conv"],
            conv_L_cache=3,
            conv_dim=64,
            block_dim=64,  # not HF config fields, but in real LFM2 config.json files, and vLLM reads them
            max_position_embeddings=1024,
        ),
    ),
    # Head dims 64 (attention and linear): vLLM's CPU Gated DeltaNet path needs them (and bfloat16).
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",  # L A L L
                "linear_attention",
                "linear_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # partial RoPE: 16 of 64 dims
            linear_num_key_heads=2,
            linear_num_value_heads=4,  # 2 value heads per key head
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[1],  # MoE at 0, 2, 3; dense at 1
            max_position_embeddings=1024,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            mlp_hidden_act="relu2",
            # M * - M -: no MoE layer, as in Nemotron-H 8B/47B/56B (vLLM-CPU has no non-gated relu2 MoE); the MoE
            # (below) is compared with HF in tests/models/test_hybrid_variants.py
            layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=64,
            routed_scaling_factor=2.5,
            time_step_min=1e-6,  # HF clamps dt >= time_step_min in prefill but not in decode: keep it out of reach
            max_position_embeddings=1024,
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            shared_intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],  # M A M M
            num_attention_heads=1,
            num_key_value_heads=1,  # head_dim = hidden / heads = 64
            num_local_experts=4,
            num_experts_per_tok=2,
            position_embedding_type="rope",
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            # Granite multipliers, not 1 and not powers of 2: embedding / residual / logits folded at load
            embedding_multiplier=1.5,
            residual_multiplier=0.7,
            logits_scaling=1.25,
            attention_multiplier=0.09,
            max_position_embeddings=1024,
        ),
    ),
}

# Families with attention layers are built with the eager (pure torch) path.
_EAGER = {
    "jamba",
    "recurrentgemma",
    "gemma3",
    "llama4",
    "bamba",
    "falcon_h1",
    "zamba2",
    "lfm2",
    "qwen3_next",
    "nemotron_h",
    "granitemoehybrid",
}


def _check_family(family: str) -> None:
    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown tiny-model family {family!r}; supported families: {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """Return a tiny config for ``family`` (one of :data:`FAMILIES`).

    ``overrides`` are passed to the config constructor and win over the
    defaults (e.g. ``tiny_config("gemma3", sliding_window=4)``).
    """
    _check_family(family)
    config_name, _, kwargs = _FAMILY_SPECS[family]
    kwargs = {**_COMMON, **kwargs, **overrides}
    if family in _EAGER:
        kwargs.setdefault("attn_implementation", "eager")
    return getattr(transformers, config_name)(**kwargs)


def _config_hash(config: transformers.PretrainedConfig) -> str:
    """Short stable hash of a config (plus library and init-scheme versions)."""
    d = config.to_dict()
    d["transformers_version"] = transformers.__version__
    d["_hybridcache_init_version"] = INIT_VERSION
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


# Parameters whose HF initialisation encodes the model's dynamics and is kept:
# SSM decay/skip/time-step parameters, RG-LRU gates, norms, convolutions, biases.
_KEEP = ("A_log", "dt_proj", "dt_bias", "recurrent_param", "input_gate", "recurrent_gate", "norm", "conv1d")


# Extra gain for SSM input projections (B, C, dt come from these) so that the
# state path, not only the D skip / short convolution, carries information.
_GAINS = {
    "mamba": {"x_proj": 4.0},
    "mamba2": {"in_proj": 3.0},
    "bamba": {"in_proj": 3.0},
    "falcon_h1": {"in_proj": 3.0},
    "zamba2": {"in_proj": 3.0},
    "nemotron_h": {"in_proj": 3.0},
    "granitemoehybrid": {"in_proj": 3.0},
}


@torch.no_grad()
def _reinit_(model: torch.nn.Module, config, seed: int, gain: float = 1.0) -> None:
    """Re-draw matrix weights at a scale that makes the tiny model's logits peaky.

    Matrices get ``N(0, gain / sqrt(hidden_size))``, input embeddings ``N(0, 1)``
    (divided by the embedding multiplier of Gemma-style models), the untied LM
    head ``N(0, 3 / sqrt(hidden_size))`` so that logits have a std of ~3.
    Everything listed in ``_KEEP`` and every 1-D parameter keeps its HF value.
    """
    gen = torch.Generator().manual_seed(10_000 + seed)
    hidden = config.hidden_size
    gains = _GAINS.get(config.model_type, {})
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    head_std = 3.0 / hidden**0.5  # logits = norm(h) @ head.T get a std of ~3
    # Gemma-style models multiply embeddings by sqrt(hidden): keep the residual stream
    # at unit scale so that the layers (hence the context) matter.
    emb_std = 1.0 / hidden**0.5 if config.model_type in ("gemma3_text", "recurrent_gemma") else 1.0
    if head is emb:  # tied (only if overridden): the head scale wins
        emb_std = head_std
    for name, p in model.named_parameters():
        if p.ndim < 2 or name.endswith(".D") or any(k in name for k in _KEEP):
            continue
        if p is emb:
            std = emb_std
        elif p is head:
            std = head_std
        else:
            module_name = name.rsplit(".", 2)[-2]
            std = gain * gains.get(module_name, 1.0) / hidden**0.5
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
    pad = config.pad_token_id
    if pad is not None and head is not emb:
        emb[pad].zero_()


def build_tiny_checkpoint(family: str, path, seed: int = 0, **overrides) -> Path:
    """Build a tiny random ``family`` model and save it (safetensors) to ``path``.

    The same ``(family, seed, overrides)`` gives bit-identical weights. The
    ByT5 tokenizer is saved alongside. Returns ``Path(path)``.
    """
    config = tiny_config(family, **overrides)
    model_cls = getattr(transformers, _FAMILY_SPECS[family][1])
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    _reinit_(model, config, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    transformers.ByT5Tokenizer().save_pretrained(path)
    return path


def _cache_root() -> Path:
    return home_dir("tiny")


# Named variants of the tiny checkpoints (family -> overrides); "tiny" is the default. "20m": larger, for benchmarks;
# "vllm": what vLLM needs where the default differs on purpose: vLLM-CPU pages chunked attention in KV blocks of a
# multiple of 32 tokens (the default llama4's chunk of 8 lets short test prompts cross chunk boundaries), and vLLM's
# LFM2 always ties its head to the embeddings (untied heads keep the tiny models from repeating their input token).
SIZES = {
    "vllm": {"llama4": dict(attention_chunk_size=32), "lfm2": dict(tie_word_embeddings=True)},
    "20m": {
        "jamba": dict(
            hidden_size=384,
            intermediate_size=640,
            num_hidden_layers=8,
            num_attention_heads=6,
            num_key_value_heads=2,
            attn_layer_period=4,
            attn_layer_offset=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_dt_rank=24,
            max_position_embeddings=65536,
        )
    },
}


def tiny_checkpoint(family: str, root=None, seed: int = 0, size: str = "tiny") -> Path:
    """Path of a cached tiny checkpoint for ``family``, building it on first use.

    The directory is ``<root>/<family>-seed<seed>-<confighash>`` where ``root``
    defaults to ``$HYBRIDCACHE_HOME/tiny`` or ``~/.cache/hybridcache/tiny``.
    Building happens in a temporary sibling directory that is atomically renamed,
    so concurrent callers (e.g. pytest-xdist workers) never see partial files.
    """
    if size != "tiny" and family not in SIZES.get(size, {}):
        known = [f"{f}/{s}" for s, fams in SIZES.items() for f in fams]
        raise ValueError(f"no size '{size}' for {family}; known: tiny (every family), {', '.join(known)}")
    overrides = SIZES[size][family] if size != "tiny" else {}
    config = tiny_config(family, **overrides)
    root = Path(root).expanduser() if root is not None else _cache_root()
    label = family if size == "tiny" else f"{family}-{size}"
    target = root / f"{label}-seed{seed}-{_config_hash(config)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        os.chmod(tmp, 0o755)
        build_tiny_checkpoint(family, tmp, seed=seed, **overrides)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

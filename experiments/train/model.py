"""The two architectures experiment=train compares, as HF configs of our families, on a byte vocabulary.

`hybrid`: Bamba (Mamba2 layers with full attention at `attn_layer_indices`). `attention`: Gemma 3 text with every
layer full attention, at the same width and depth. `recurrent`: the hybrid's twin without attention (Bamba, every
layer Mamba2): the other end, where everything before the current byte passes through the recurrent state.
All use ByT5's byte vocabulary (256 bytes + 3 specials + 125 sentinels = 384 ids, as the tiny checkpoints do), so
the embedding stays small and any text tokenizes offline.
Both train with HF transformers' own modules (pure-torch paths on CPU) and export with `save_pretrained`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import transformers

ARCHS = ("hybrid", "attention", "recurrent")
VOCAB = dict(vocab_size=384, pad_token_id=0, eos_token_id=1, bos_token_id=None)


class ArchError(ValueError):
    """An unknown architecture or a size setting that does not fit it."""


def hf_config(arch: str, size: dict[str, Any]) -> transformers.PretrainedConfig:
    """The HF config of `arch` at `size` (hidden, layers, heads, kv_heads, head_dim, intermediate, attention_every,
    mamba_heads, state, chunk, max_positions; conv: the Mamba2 conv kernel, 4 if absent)."""
    d, n = int(size["hidden"]), int(size["layers"])
    common = dict(
        VOCAB,
        hidden_size=d,
        num_hidden_layers=n,
        intermediate_size=int(size["intermediate"]),
        num_attention_heads=int(size["heads"]),
        num_key_value_heads=int(size["kv_heads"]),
        head_dim=int(size["head_dim"]),
        max_position_embeddings=int(size["max_positions"]),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    if arch in ("hybrid", "recurrent"):
        every = int(size["attention_every"])
        mamba_heads = int(size["mamba_heads"])
        if (2 * d) % mamba_heads:
            raise ArchError(f"2 * hidden ({2 * d}) must be a multiple of mamba_heads ({mamba_heads})")
        # attention in the middle of each group of `every` layers, e.g. every=4, n=8: M M A M M M A M
        attn = [i for i in range(n) if i % every == every // 2] if arch == "hybrid" else []
        return transformers.BambaConfig(
            **common,
            attn_layer_indices=attn,
            mamba_n_heads=mamba_heads,
            mamba_d_head=2 * d // mamba_heads,
            mamba_n_groups=1,
            mamba_d_state=int(size["state"]),
            mamba_d_conv=int(size.get("conv", 4)),
            mamba_expand=2,
            mamba_chunk_size=int(size["chunk"]),
            rope_theta=10000.0,
        )
    if arch == "attention":
        # Gemma 3 with every layer global: no sliding windows, so it sees as far back as the hybrid's attention
        return transformers.Gemma3TextConfig(
            **common,
            layer_types=["full_attention"] * n,
            sliding_window=int(size["max_positions"]),
            query_pre_attn_scalar=int(size["head_dim"]),
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            rope_theta=10000.0,
        )
    raise ArchError(f"experiment.arch must be one of {', '.join(ARCHS)}, got {arch!r}")


SSM_INITS = ("hf", "mamba")


def mamba_ssm_init(model: torch.nn.Module, seed: int) -> int:
    """Re-initialise every Mamba2 mixer's time steps and decays as the Mamba2 reference does (mamba_ssm's
    Mamba2.__init__): dt = exp(U(log 1e-3, log 0.1)) floored at 1e-4, dt_bias = softplus^-1(dt); A = U(1, 16),
    A_log = log A. HF's Bamba init sets dt_bias = 1 (softplus 1.31) and A = 1..H, so a state decays by
    exp(-A * 1.31) per byte, 0.27 at best: it forgets within a few bytes, and a model trained from it learns to do
    without its SSM state (measured: zeroing it costs 1e-4 bits/byte). Returns the number of mixers changed."""
    g = torch.Generator().manual_seed(seed + 7919)
    mixers = [m for m in model.modules() if hasattr(m, "dt_bias") and hasattr(m, "A_log")]
    with torch.no_grad():
        for m in mixers:
            h = m.dt_bias.shape[0]
            dt = torch.exp(torch.rand(h, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp(min=1e-4)
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            m.A_log.copy_(torch.log(torch.empty(h).uniform_(1, 16, generator=g)))
    return len(mixers)


def hf_model(
    arch: str, size: dict[str, Any], seed: int, attention_window: int | None = None, ssm_init: str = "hf"
) -> transformers.PreTrainedModel:
    """A freshly initialised HF model (HF's own init, seeded) in float32, in training mode. `attention_window`
    (recorded in its config, so the export carries it) restricts its attention in training (train_loop.model_logits).
    `ssm_init="mamba"` re-initialises the Mamba2 time steps and decays as the Mamba2 reference does
    (mamba_ssm_init)."""
    if ssm_init not in SSM_INITS:
        raise ArchError(f"ssm_init must be one of {', '.join(SSM_INITS)}, got {ssm_init!r}")
    config = hf_config(arch, size)
    if attention_window is not None:
        if isinstance(attention_window, bool) or not isinstance(attention_window, int) or attention_window < 1:
            raise ArchError(f"attention_window must be a positive integer or null, got {attention_window!r}")
        if arch != "recurrent":  # no attention layer to restrict (HF's Mamba layers ignore a 4D mask)
            config.attention_window = attention_window
    cls = transformers.Gemma3ForCausalLM if arch == "attention" else transformers.BambaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    if ssm_init == "mamba":
        mamba_ssm_init(model, seed)
    return model.train()


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

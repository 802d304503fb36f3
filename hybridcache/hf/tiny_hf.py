"""Tiny random checkpoints of any HF causal LM family, built with HF's own classes (for the bridge's tests and its
coverage table): the family's default config with every size field shrunk, seeded weights, float32.

`tiny_config(model_type)` starts from the config class's defaults and overrides, among the fields that class has,
the generic sizes below (a field the class lacks is left alone), then a family's own fixes (`FAMILY_FIXES`: fields
whose defaults are tied to others, e.g. Mamba2's heads x head_dim = expand x hidden). Composite configs (a text
config inside a multimodal one) get the same treatment on their text config and the smallest vision sizes.
`tiny_model` builds it on the meta device first and refuses one above `MAX_PARAMS` before allocating anything.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hybridcache.checkpoints.tiny import reinit_weights_

MAX_PARAMS = 20_000_000  # a tiny model stays tiny: a shrink that missed a field is refused before allocation

VOCAB = 384
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    # mixture of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    # state-space and linear-attention layers
    mamba_d_state=8,
    mamba_expand=2,
    mamba_dt_rank=8,
    state_size=8,
    time_step_rank=8,
    n_groups=1,
    mamba_n_groups=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    # older naming (GPT-2, CodeGen, CTRL, MPT, XGLM, XLM, ...)
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_inner=128,
    n_positions=512,
    n_ctx=512,
    rotary_dim=8,
    dff=128,
    d_model=64,
    n_layers=4,
    n_heads=4,
    num_layers=4,
    attention_heads=4,
    ffn_dim=128,
    emb_dim=64,
    d_inner=128,
    n_layer_decoder=4,
    decoder_layers=4,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    # a causal LM, also where the architecture is an encoder's (BERT-style *ForCausalLM need is_decoder)
    is_decoder=True,
    # untied heads: a tiny random model with tied embeddings mostly predicts its own input token
    tie_word_embeddings=False,
    pad_token_id=0,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    depth=1,
    num_attention_heads=2,
    num_heads=2,
    image_size=28,
    patch_size=14,
    out_hidden_size=64,
)
WINDOWED = dict(sliding_window=8, attention_chunk_size=8)  # only where the default is not None (on by default)

# Fields of a family whose defaults are tied to the sizes above (found by building each family; the coverage table
# names families that still do not build).
FAMILY_FIXES: dict[str, dict[str, Any]] = {
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, chunk_size=8),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=1),
    "zamba2": dict(mamba_headdim=16, mamba_ngroups=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=8),
    "zaya": dict(num_experts_per_tok=1),
    "dots3_note": dict(head_dim=16),
    "dots3_note_text": dict(head_dim=16),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8),
    # every layer type, compress rates a short prompt closes windows of, an indexer that keeps 2 of its entries
    "deepseek_v4": dict(
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_topk=2,
        index_n_heads=2,
        index_head_dim=8,
        o_groups=2,
        o_lora_rank=16,
    ),
}


def _shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    kw = {k: v for k, v in GENERIC.items() if k in defaults}
    kw.update({k: v for k, v in WINDOWED.items() if defaults.get(k) is not None})
    layers = kw.get("num_hidden_layers", 4)
    if "kv_lora_rank" in defaults:  # multi-head latent attention: keys expanded per head, rope on head_dim
        if "num_key_value_heads" in defaults:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        if "head_dim" in defaults:
            kw["head_dim"] = kw["qk_rope_head_dim"]
        if "qk_head_dim" in defaults:
            kw["qk_head_dim"] = kw["qk_rope_head_dim"] + kw["qk_nope_head_dim"]
    if isinstance(defaults.get("layer_types"), list):  # re-derived from the layer count (or cut to it)
        kw["layer_types"] = _cut_list(defaults["layer_types"], layers)
    if isinstance(defaults.get("per_layer_config"), dict):  # per-layer overrides beyond the layer count go
        kw["per_layer_config"] = {k: v for k, v in defaults["per_layer_config"].items() if int(k) < layers}
    for key in ("activation_sparsity_pattern",):  # per-layer lists
        if isinstance(defaults.get(key), list):
            kw[key] = _cut_list(defaults[key], layers)
    if isinstance(defaults.get("num_kv_shared_layers"), int) and defaults["num_kv_shared_layers"]:
        kw["num_kv_shared_layers"] = 2  # the last 2 layers read earlier ones' keys: each kind must come before
        if isinstance(defaults.get("layer_types"), list):
            kinds = list(dict.fromkeys(defaults["layer_types"]))
            kw["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    if isinstance(defaults.get("vocab_size_per_layer_input"), int):
        kw["vocab_size_per_layer_input"] = VOCAB
    return kw


def _cut_list(values: list, n: int) -> list:
    """The first n entries, keeping every distinct value (a hybrid keeps each layer kind) by putting the kinds the
    first n miss at the end."""
    head = list(values[:n])
    missing = [v for v in dict.fromkeys(values) if v not in head]
    if missing and len(missing) < n:
        head = head[: n - len(missing)] + missing
    return head


def our_family(model_type: str) -> str | None:
    """The hybridcache family (hybridcache.checkpoints.tiny) whose tiny HF config is `model_type`'s, if any."""
    import transformers

    from hybridcache.checkpoints.tiny_recipes import FAMILY_RECIPES

    for family, (config_name, _, _) in FAMILY_RECIPES.items():
        cls = getattr(transformers, config_name, None)
        if cls is not None and getattr(cls, "model_type", None) == model_type:
            return family
    return None


def tiny_config(model_type: str, **overrides: Any):
    """A tiny config of `model_type` (a key of transformers' CONFIG_MAPPING); `overrides` win. Families hybridcache
    implements get their own tiny config (hybridcache.checkpoints.tiny: every cache-relevant path of the family)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = our_family(model_type)
    if family is not None:
        from hybridcache.checkpoints.tiny import tiny_config as our_tiny_config

        return our_tiny_config(family, **overrides)
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    fixes = FAMILY_FIXES.get(model_type, {})
    kw = _shrink(defaults)
    kw.update(fixes)
    for sub in ("text_config",):  # composite configs: shrink the text config in place
        if isinstance(defaults.get(sub), dict):
            text = copy.deepcopy(defaults[sub])
            text.update(_shrink(text))
            text.update(FAMILY_FIXES.get(text.get("model_type", ""), {}))
            kw[sub] = text
    if isinstance(defaults.get("vision_config"), dict):  # a vision tower the text-only tests never run: smallest
        vision = copy.deepcopy(defaults["vision_config"])
        vision.update({k: v for k, v in VISION.items() if k in vision})
        kw["vision_config"] = vision
    kw.update(overrides)
    return cls(**kw)


def tiny_model(model_type: str, seed: int = 0, causal_lm_class: str | None = None, **overrides: Any):
    """A tiny random `model_type` causal LM (float32, eval mode, seeded; weights drawn as hybridcache's tiny
    checkpoints draw them), built with HF's own classes."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type, **overrides)
    cls = getattr(transformers, causal_lm_class or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    wanted = getattr(cls, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted) and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)  # a composite config's CausalLM takes its text config
    with torch.device("meta"):
        probe = cls(config)
    n = sum(p.numel() for p in probe.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"tiny {model_type}: {n:,} parameters after shrinking (more than {MAX_PARAMS:,})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32).eval()
    text = config.get_text_config(decoder=True)
    if not hasattr(text, "pad_token_id"):  # reinit_weights_ zeroes the pad row when there is one
        text.pad_token_id = None
    reinit_weights_(model, text, seed)  # peaky logits: no near-ties in greedy tests
    return model

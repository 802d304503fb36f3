"""Tiny checkpoint specs of the families added for issue 25, in the same form as ``tiny_specs.FAMILY_SPECS``
(family -> (HF config class name, HF model class name, config values)); kept apart so each file stays short.
``RECENT_EAGER`` lists those built with HF's eager attention path."""

RECENT_SPECS: dict[str, tuple[str, str, dict]] = {
    "gemma4": (  # S F S F; layers 2-3 read layers 0-1's K/V; PLE, experts beside the MLP, global head_dim 128, k_eq_v
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            global_head_dim=128,  # proportional RoPE on a quarter of it
            num_global_key_value_heads=1,
            attention_k_eq_v=True,  # global layers: no v_proj
            sliding_window=8,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=384,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            use_double_wide_mlp=True,  # the readers' MLPs are twice as wide
            final_logit_softcapping=30.0,
            max_position_embeddings=1024,
        ),
    ),
    "zamba": (  # two-head Mamba v1 layers + one shared attention block over [h | embeddings] at two layers
        "ZambaConfig",
        "ZambaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=5,
            tie_word_embeddings=True,  # HF ties the shared block's copies only with tied embeddings
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "linear_attention"],
            num_attention_heads=2,  # attention head_dim 2 * 64 / 2 = 64
            num_key_value_heads=1,
            n_mamba_heads=2,
            mamba_d_state=16,
            max_position_embeddings=1024,
            initializer_range=0.5,  # HF draws the Mamba conv (kept by reinit) with this std: at 0.02 the layers vanish
        ),
    ),
    "kimi_linear": (  # KDA (per-channel decay) + MLA without RoPE (qk 64 = nope 32 + rope 32, v 32), DeepSeek-V3 MoE
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],  # L A L A
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=32,  # narrower than the keys: the cache pads values to 64
            linear_num_heads=2,
            linear_head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=2,  # group-limited routing: 1 of 2 groups of 2 experts
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            max_position_embeddings=1024,
        ),
    ),
    "bailing_hybrid": (  # KDA (safe gate) + MLA (interleaved RoPE, per-head gate) as L A L A, DeepSeek-V3 MoE
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            layer_group_size=2,  # L A L A
            first_k_dense_replace=1,
            num_attention_heads=4,  # MLA heads and KDA heads
            num_key_value_heads=4,
            head_dim=32,  # KDA head size; = qk_rope_head_dim, what HF's save writes back as head_dim
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,  # MLA heads 64 wide (keys 32 + 32, values 64)
            rope_theta=10_000.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            max_position_embeddings=1024,
        ),
    ),
    "olmo_hybrid": (  # Gated DeltaNet (beta in [0, 2]) + OLMo 3 post-norm attention with whole-projection q/k norms
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],  # L A L L
            num_attention_heads=4,
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,  # HF's mixer repeats no heads: value heads = key heads
            linear_key_head_dim=32,
            linear_value_head_dim=64,
            max_position_embeddings=1024,
        ),
    ),
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,  # HF's default plan: full, sliding, sliding, sliding
            num_attention_heads=4,
            num_key_value_heads=2,  # head_dim 16
            sliding_window=8,
            layer_rope_theta=[10_000.0, 0.0, 500_000.0, 10_000.0],  # two RoPE bases and a NoPE layer
            embedding_multiplier=1.5,  # Granite's multipliers, none of them 1
            residual_multiplier=0.7,
            logits_scaling=1.25,
            attention_multiplier=0.2,
            max_position_embeddings=1024,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,  # HF's default plan: sliding, full, sliding, full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.5,  # reached by the tiny model's activations: the clamps matter
            initializer_range=1.0,  # HF draws the sinks and router biases (1-D, kept by reinit) with this std
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 256,
            },
            max_position_embeddings=1024,
        ),
    ),
    "glm5_next": (  # mHC (3 streams) + KDA + DSA (MLA NoPE; picks 2 pools of 2 + tail; layer 2 reuses layer 1 pick)
        "Glm5NextConfig",  # HF has no text-only LM class: the composite model, text-only input (registered below)
        "Glm5NextForConditionalGeneration",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=0,
            v_head_dim=16,  # narrower than the keys: the cache pads values to 32
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=8,
            index_kpool=2,
            linear_num_heads=4,
            linear_head_dim=16,
            hc_mult=3,
            swiglu_limit=1.5,  # reached by the tiny model's activations: the clamps matter
            max_position_embeddings=1024,
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64),
        ),
    ),
}

RECENT_EAGER: set[str] = {"granite_swa", "gpt_oss"}


def register_hf_auto_classes() -> None:
    """GLM-5-Next has no text-only causal-LM class in HF: its composite model (text-only input) serves as HF's
    AutoModelForCausalLM for the tiny checkpoint, which is what tests and references load."""
    import transformers

    if hasattr(transformers, "Glm5NextConfig"):
        transformers.AutoModelForCausalLM.register(
            transformers.Glm5NextConfig, transformers.Glm5NextForConditionalGeneration, exist_ok=True
        )


register_hf_auto_classes()

"""How each tiny checkpoint is built (checkpoints/tiny.py builds them): per family the HF config and model class names
and the config values that exercise every cache-relevant path of the family, plus named larger variants (SIZES)."""

# Untied LM heads: with tied embeddings a tiny random model mostly predicts its
# own input token (e_t . e_t dominates the logits), so greedy decoding repeats it.
COMMON = dict(vocab_size=384, pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)

FAMILY_RECIPES = {
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
    "qwen3_5": (  # Qwen3-Next without MoE, separate linear-attention projections
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],  # L A L L
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # partial RoPE: 16 of 64 dims
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            max_position_embeddings=1024,
        ),
    ),
    "lfm3": (  # LFM2's short convs + sliding and full attention (sandwich norms, per-head output gates)
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=5,
            layer_types=["conv", "sliding_attention", "conv", "full_attention", "conv"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # full layers: proportional RoPE on 32 of 64 dims
            sliding_window=8,
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
    # the families added for issue 25
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

# Families with attention layers are built with the eager (pure torch) path.
EAGER = {
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
    "qwen3_5",
    "lfm3",
    "granite_swa",
    "gpt_oss",
}

# Named variants of the tiny checkpoints (family -> overrides); "tiny" is the default. "20m": larger, for benchmarks;
# "vllm": what vLLM needs where the default differs on purpose: vLLM-CPU pages chunked attention in KV blocks of a
# multiple of 32 tokens (the default llama4's chunk of 8 lets short test prompts cross chunk boundaries), vLLM's
# LFM2 always ties its head to the embeddings (untied heads keep the tiny models from repeating their input token),
# vLLM-CPU's attention has no kernel for head size 16 (granite_swa, olmo_hybrid: 64 here), and vLLM's GPT-OSS
# clamps its SwiGLU at a hard-coded 7.0 whatever swiglu_limit says (the default's 1.5 exercises HF's clamp).
SIZES = {
    "vllm": {
        "llama4": dict(attention_chunk_size=32),
        "lfm2": dict(tie_word_embeddings=True),
        "granite_swa": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
        "olmo_hybrid": dict(head_dim=64, linear_key_head_dim=64),
        "gpt_oss": dict(swiglu_limit=7.0),
    },
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


def register_hf_auto_classes() -> None:
    """GLM-5-Next has no text-only causal-LM class in HF: its composite model (text-only input) serves as HF's
    AutoModelForCausalLM for the tiny checkpoint, which is what tests and references load."""
    import transformers

    if hasattr(transformers, "Glm5NextConfig"):
        transformers.AutoModelForCausalLM.register(
            transformers.Glm5NextConfig, transformers.Glm5NextForConditionalGeneration, exist_ok=True
        )


register_hf_auto_classes()

"""Tiny checkpoint specs of the families added for issue 25, in the same form as ``tiny_specs.FAMILY_SPECS``
(family -> (HF config class name, HF model class name, config values)); kept apart so each file stays short.
``RECENT_EAGER`` lists those built with HF's eager attention path."""

RECENT_SPECS: dict[str, tuple[str, str, dict]] = {
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
}

RECENT_EAGER: set[str] = set()

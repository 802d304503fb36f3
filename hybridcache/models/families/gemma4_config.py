"""Gemma 4's typed config (HF Gemma4TextConfig, transformers 5.23): the sliding / global plan, each layer's head_dim
and kv heads (global layers: `per_layer_config`, or the older `global_head_dim` / `num_global_key_value_heads`), the
KV-sharing split (writers, then `num_kv_shared_layers` readers), PLE and expert sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridcache.models.core.family_config import param
from hybridcache.models.core.layer_pattern import SlidingFullFields

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(kw_only=True)
class Gemma4Config(SlidingFullFields):
    """HF Gemma4TextConfig (transformers 5.23) fields the model reads, with HF defaults. Global layers take
    `per_layer_config` (what HF saves), else `global_head_dim` / `num_global_key_value_heads` (its init kwargs)."""

    family: ClassVar[str] = "gemma4"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(9216, positive=True)
    num_attention_heads: int = param(8, positive=True)
    num_key_value_heads: int | None = param(4, positive=True)
    head_dim: int | None = param(256, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = param(131_072, positive=True)
    sliding_window: int | None = param(512, positive=True)
    final_logit_softcapping: float | None = param(None, positive=True)
    use_bidirectional_attention: str | None = param(None, choices=("vision", "all"))
    vocab_size_per_layer_input: int = param(262_144, positive=True)
    hidden_size_per_layer_input: int | None = param(256, nonnegative=True)  # 0 / None: no PLE
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = param(0, nonnegative=True)
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = param(None, positive=True)
    top_k_experts: int | None = param(None, positive=True)
    moe_intermediate_size: int | None = param(None, positive=True)
    global_head_dim: int = param(512, positive=True)
    num_global_key_value_heads: int | None = param(None, positive=True)
    per_layer_config: dict | None = None

    def default_layer_types(self) -> list[str]:  # 5 sliding : 1 global
        return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(self.num_hidden_layers)]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # HF forces the last layer global
        self.rope_parameters = self.rope_parameters or DEFAULT_ROPE
        if self.per_layer_config is None:
            kv = self.num_global_key_value_heads if self.attention_k_eq_v else None
            over = {"head_dim": self.global_head_dim, **({"num_key_value_heads": kv} if kv else {})}
            self.per_layer_config = {str(i): over for i, t in enumerate(self.layer_types) if t == "full_attention"}

    @property
    def writers(self) -> int:
        """Layers with their own keys/values (and cache entry): all but the last num_kv_shared_layers."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def layer_shape(self, i: int) -> tuple[int, int]:
        """(head_dim, kv heads) of layer i."""
        over = self.per_layer_config.get(str(i), self.per_layer_config.get(i, {}))  # JSON keys are strings
        return over.get("head_dim", self.head_dim), over.get("num_key_value_heads", self.num_key_value_heads)

    def problems(self) -> list[str]:
        out = super().problems()
        if self.use_bidirectional_attention == "all":
            out.append("use_bidirectional_attention 'all' (non-causal text attention) is not supported")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            out.append(f"num_kv_shared_layers ({self.num_kv_shared_layers}) must be < num_hidden_layers")
        elif set(self.layer_types[self.writers :]) - set(self.layer_types[: self.writers]):
            out.append("a KV-shared layer type has no earlier layer of that type to read keys/values from")
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            out.append("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        heads = self.num_attention_heads
        out += [f"layer {i}: {heads} heads not a multiple of {kv} kv heads" for i in range(self.num_hidden_layers)
                if heads % (kv := self.layer_shape(i)[1])]  # fmt: skip
        return out

"""Zamba2 (Zyphra): Mamba2 layers, and at some of them ("hybrid" layers) a shared transformer block first.

    mamba layer:   h = h + mamba(input_layernorm(h))
    hybrid layer:  t = linear_i(shared_b(h, e, use));  h = h + mamba(input_layernorm(h + t))
    shared_b(h, e, use) = MLP_use(pre_ff_layernorm(attention_use(input_layernorm([h, e]))))   (no inner residuals)

`e` are the original token embeddings: the residual stream carries them beside h ([h | e], 2 * hidden wide from
`embed` to `head`), so no state lives outside the decoder layers. There are `num_mem_blocks` shared blocks, used
round-robin by the hybrid layers (use k runs block k % num_mem_blocks); each use has its own KV cache (every hybrid
layer is a cache group {"attention": full, "mamba": mamba2}) and its own LoRA-style adapters (on q/k/v when
`use_shared_attention_adapter`, always on the MLP's gate_up_proj), stored inside the shared block like HF does.

Shared weights: a block's parameters live once, under the HF names of its first hybrid layer
(`model.layers.{first}.shared_transformer.*`); later layers hold an unregistered reference. Checkpoints saved with
tied weights hold only those names; checkpoints that repeat a block under every layer's name are aliased by
`convert_checkpoint`, which requires the copies to be identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheGroup, CacheLayer, NativeGroup, NativeLayer
from hybridcache.models.core.family_config import FamilyConfig, attention_problems, param
from hybridcache.models.core.loading import CheckpointError
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.mlp import activation
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer

LEGACY_TYPES = {"mamba": "linear_attention"}  # HF remaps legacy layer type names


@dataclass(kw_only=True)
class Zamba2Config(FamilyConfig):
    """HF Zamba2Config (transformers 5) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "zamba2"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    max_position_embeddings: int = param(4096, positive=True)
    layers_block_type: list[str] | None = param(None, choices=("linear_attention", "hybrid", "mamba"))
    mamba_d_state: int = param(64, positive=True)
    mamba_d_conv: int = param(4, positive=True)
    mamba_expand: int = param(2, positive=True)
    mamba_ngroups: int = param(1, positive=True)
    time_step_min: float = param(0.001, nonnegative=True)
    n_mamba_heads: int = param(8, positive=True)
    chunk_size: int = param(256, positive=True)
    add_bias_linear: bool = False
    intermediate_size: int | None = param(None, positive=True)  # None: 4 * hidden_size
    hidden_act: str = "gelu"
    num_attention_heads: int = param(32, positive=True)
    num_key_value_heads: int | None = param(None, positive=True)  # None: num_attention_heads
    num_mem_blocks: int = param(1, positive=True)
    use_shared_attention_adapter: bool = False
    adapter_rank: int = param(128, positive=True)
    use_mem_rope: bool = False
    rope_parameters: dict | None = None
    rope_theta: float = param(10000.0, positive=True)  # older configs; rope_parameters wins
    rms_norm_eps: float = param(1e-5, positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size

    @property
    def block_types(self) -> list[str]:
        """ "linear_attention" (Mamba2) or "hybrid" (shared block + Mamba2) per layer; HF's 54-layer default."""
        if self.layers_block_type is None:
            m, h = "linear_attention", "hybrid"
            return [m] + ([m] * 5 + [h]) * 7 + [m] * 4 + [h] + [m] * 3 + [h] + [m] * 2
        return [LEGACY_TYPES.get(t, t) for t in self.layers_block_type]

    @property
    def attention_head_dim(self) -> int:
        return 2 * self.hidden_size // self.num_attention_heads

    @property
    def mamba_headdim(self) -> int:
        return self.mamba_expand * self.hidden_size // self.n_mamba_heads

    def problems(self) -> list[str]:
        out = attention_problems(self)
        if len(self.block_types) != self.num_hidden_layers:
            out.append(
                f"layers_block_type has {len(self.block_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        if (2 * self.hidden_size) % self.num_attention_heads:
            out.append(
                f"2 * hidden_size ({2 * self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if (self.mamba_expand * self.hidden_size) % self.n_mamba_heads:
            out.append(f"n_mamba_heads ({self.n_mamba_heads}) must divide mamba_expand * hidden_size")
        if self.n_mamba_heads % self.mamba_ngroups:
            out.append(
                f"n_mamba_heads ({self.n_mamba_heads}) must be a multiple of mamba_ngroups ({self.mamba_ngroups})"
            )
        if self.use_shared_attention_adapter and self.num_key_value_heads != self.num_attention_heads:
            out.append(
                "use_shared_attention_adapter needs num_key_value_heads == num_attention_heads (the k/v "
                "adapters are 2 * hidden_size wide)"
            )
        return out

    def rope(self) -> dict[str, Any]:
        params = dict(self.rope_parameters or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", self.rope_theta)
        return params


def adapter(cfg: Zamba2Config, n_in: int, n_out: int, mine: bool) -> nn.Module:
    """A rank-r adapter (down, up) for a use of this block, or an Identity placeholder for another block's use."""
    if not mine:
        return nn.Identity()
    return nn.Sequential(nn.Linear(n_in, cfg.adapter_rank, bias=False), nn.Linear(cfg.adapter_rank, n_out, bias=False))


class Zamba2MLP(nn.Module):
    """down(act(gate) * up) with [gate | up] = gate_up_proj(x) + gate_up_proj_adapter_list[use](x)."""

    def __init__(self, cfg: Zamba2Config, mine: list[bool]) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * i, bias=cfg.add_bias_linear)
        self.down_proj = nn.Linear(i, d, bias=cfg.add_bias_linear)
        self.gate_up_proj_adapter_list = nn.ModuleList(adapter(cfg, d, 2 * i, m) for m in mine)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:  # [B, T, D]
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """HF `Zamba2AttentionDecoderLayer`: attention over norm([h | e]) (2 * hidden wide, scale (head_dim / 2)^-0.5),
    then pre_ff_layernorm and the MLP. Block `block_id` owns the adapters of the uses k with k % blocks == block_id."""

    def __init__(self, cfg: Zamba2Config, block_id: int, uses: int, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d2, hd = 2 * cfg.hidden_size, cfg.attention_head_dim
        mine = [k % cfg.num_mem_blocks == block_id for k in range(uses)]
        self.input_layernorm = RMSNorm(d2, cfg.rms_norm_eps)
        self.self_attn = AttentionMixer(
            d2,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
            scale=(hd / 2) ** -0.5,
            rotary=rotary,
            out_hidden=cfg.hidden_size,
        )
        self.adapted = cfg.use_shared_attention_adapter
        if self.adapted:  # HF names: self_attn.linear_{q,k,v}_adapter_list.{use}.{0,1}.weight
            for name in ("q", "k", "v"):
                lists = nn.ModuleList(adapter(cfg, d2, d2, m) for m in mine)
                self.self_attn.add_module(f"linear_{name}_adapter_list", lists)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = Zamba2MLP(cfg, mine)

    def forward(self, he: torch.Tensor, use: int, layer: CacheLayer, step: StepInput) -> torch.Tensor:
        x = self.input_layernorm(he)  # [B, T, 2D]
        extra = None
        if self.adapted:
            a = self.self_attn
            extra = tuple(
                lists[use](x) for lists in (a.linear_q_adapter_list, a.linear_k_adapter_list, a.linear_v_adapter_list)
            )
        y = self.self_attn(x, layer, step, extra=extra)  # [B, T, D]
        return self.feed_forward(self.pre_ff_layernorm(y), use)


def mamba2_mixer(cfg: Zamba2Config) -> Mamba2Mixer:
    return Mamba2Mixer(
        cfg.hidden_size,
        cfg.n_mamba_heads,
        cfg.mamba_headdim,
        cfg.mamba_d_state,
        cfg.mamba_ngroups,
        cfg.mamba_d_conv,
        cfg.chunk_size,
        use_conv_bias=True,
        use_bias=cfg.add_bias_linear,
        time_step_limit=(cfg.time_step_min, math.inf),
        rms_norm=True,
        norm_before_gate=False,
        eps=1e-5,
    )


class MambaResidual(nn.Module):
    """h + mixer(input_layernorm(h + t)) on the h half of [h | e] (t: the shared block's contribution, or none)."""

    def __init__(self, hidden: int, eps: float, mixer: nn.Module) -> None:
        super().__init__()
        self.hidden = hidden
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mamba = mixer

    def forward(
        self, he: torch.Tensor, layer: CacheLayer, step: StepInput, t: torch.Tensor | None = None
    ) -> torch.Tensor:  # [B, T, 2D]
        h, e = he.split(self.hidden, dim=-1)
        x = self.input_layernorm(h if t is None else h + t)
        return torch.cat([h + self.mamba(x, layer, step), e], dim=-1)


class SharedBlockLayer(nn.Module):
    """shared block (use `use`) -> linear -> the Mamba layer; the block is registered (as `name`, HF's) only at its
    first use, later layers hold a plain reference."""

    def __init__(self, hidden: int, name: str, shared: nn.Module, use: int, owner: bool, mamba: MambaResidual) -> None:
        super().__init__()
        if owner:
            self.add_module(name, shared)
        self._shared = (shared,)  # a plain reference: the parameters belong to the owner layer
        self.use = use
        self.linear = nn.Linear(hidden, hidden, bias=False)
        self.mamba_decoder = mamba

    def forward(self, he: torch.Tensor, group: CacheGroup, step: StepInput) -> torch.Tensor:  # [B, T, 2D]
        t = self.linear(self._shared[0](he, self.use, group.attention, step))
        return self.mamba_decoder(he, group["mamba"], step, t)


@register_family("zamba2")
class Zamba2LM(StackLM):
    """The Zamba skeleton: a plan of "hybrid" / mamba layers, `num_mem_blocks` shared blocks used round-robin.
    Zamba (v1) overrides the block, the Mamba layer, the shared block's name and the Mamba cache."""

    family = "zamba2"
    config_class = Zamba2Config
    final_norm_name = "final_layernorm"
    shared_name: ClassVar[str] = "shared_transformer"

    def plan(self) -> list[str]:
        return self.cfg.block_types

    def make_block(self, block_id: int, uses: int, rotary: RotaryEmbedding | None) -> nn.Module:
        return Zamba2SharedBlock(self.cfg, block_id, uses, rotary)

    def make_mamba(self) -> MambaResidual:
        return MambaResidual(self.cfg.hidden_size, self.cfg.rms_norm_eps, mamba2_mixer(self.cfg))

    def native_mamba(self) -> NativeLayer:
        c = self.cfg
        shapes = {"num_heads": c.n_mamba_heads, "head_dim": c.mamba_headdim, "state_size": c.mamba_d_state}
        return NativeLayer(
            "mamba2", {**shapes, "n_groups": c.mamba_ngroups, "conv_kernel": c.mamba_d_conv, "dtype": self.dtype}
        )

    def shared(self) -> list[nn.Module]:
        c, uses = self.cfg, self.kinds.count("hybrid")
        rotary = None
        if c.use_mem_rope:
            rotary = RotaryEmbedding(*rope_frequencies(c.to_dict(), c.rope(), c.attention_head_dim))
        self.owners: dict[int, int] = {}  # block -> the layer index that registers it
        return [self.make_block(b, uses, rotary) for b in range(min(self.cfg.num_mem_blocks, uses))]

    def build_layer(self, kind: str, index: int, blocks: list[nn.Module]) -> nn.Module:
        if kind != "hybrid":
            return self.make_mamba()
        use = self.kinds[:index].count("hybrid")
        block = use % self.cfg.num_mem_blocks
        owner = self.owners.setdefault(block, index) == index
        return SharedBlockLayer(self.cfg.hidden_size, self.shared_name, blocks[block], use, owner, self.make_mamba())

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Alias a shared block repeated under later layers' names to its first layer's tensors (must be equal)."""
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer, SharedBlockLayer):
                continue
            owner = self.owners[layer.use % self.cfg.num_mem_blocks]
            if owner == i:
                continue
            prefix, target = f"model.layers.{i}.{self.shared_name}.", f"model.layers.{owner}.{self.shared_name}."
            for name in [k for k in state if k.startswith(prefix)]:
                tensor, main = state.pop(name), target + name[len(prefix) :]
                if main not in state:
                    state[main] = tensor
                elif not torch.equal(state[main], tensor):
                    raise CheckpointError(
                        f"{name} differs from {main}: {self.family} layers {owner} and {i} share one block, but this "
                        "checkpoint holds different weights for them (HF transformers 5 ties them only when "
                        "tie_word_embeddings is true)"
                    )
        return state

    def native_layers(self) -> list[NativeLayer | NativeGroup]:
        c, mamba = self.cfg, self.native_mamba()
        attn = NativeLayer(
            "full", {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attention_head_dim, "dtype": self.dtype}
        )
        return [NativeGroup({"attention": attn, "mamba": mamba}) if k == "hybrid" else mamba for k in self.kinds]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(input_ids)  # [B, T, D]
        return torch.cat([e, e], dim=-1)  # [h | e]: the stream starts at the embeddings and carries them along

    def head(self, he: torch.Tensor) -> torch.Tensor:
        return super().head(he[..., : self.cfg.hidden_size])  # [B, T, V]

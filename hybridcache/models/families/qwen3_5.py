"""Qwen3.5 (text): Qwen3-Next's layers without the MoE. Gated DeltaNet linear attention whose input projections are
separate (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, q k v contiguous rather than grouped per key head),
gated full attention (output gate, partial RoPE, (1 + w) q/k norms), dense SwiGLU MLPs.

HF's text RoPE is multimodal (MRoPE), but for text all three position axes are the token position, so it is plain
partial RoPE. Caches: `gated_delta` (conv + delta-rule state) and `full`, as Qwen3-Next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.delta import DeltaForm, delta_accel
from hybridcache.cache import NativeLayer
from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.models.families.qwen3_next import Qwen3NextConfig, Qwen3NextDecoderLayer, delta_native_layers
from hybridcache.nn import RotaryEmbedding
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer


@dataclass(kw_only=True)
class Qwen35Config(Qwen3NextConfig):
    """HF Qwen3_5TextConfig: Qwen3-Next's fields less the MoE ones (HF defaults where they differ)."""

    family: ClassVar[str] = "qwen3_5"
    intermediate_size: int = param(12288, positive=True)
    num_key_value_heads: int = param(4, positive=True)
    num_experts: int = param(0, nonnegative=True)  # dense MLPs only

    def is_moe(self, i: int) -> bool:
        return False


class Qwen35GatedDeltaNet(GatedDeltaNetMixer):
    """Qwen3-Next's mixer with Qwen3.5's projections: [q | k | v] = in_proj_qkv(h), z, b, a each their own."""

    def __init__(self, hidden: int, hk: int, hv: int, dk: int, dv: int, *args) -> None:
        super().__init__(hidden, hk, hv, dk, dv, *args)
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = nn.Linear(hidden, 2 * hk * dk + hv * dv, bias=False)
        self.in_proj_z = nn.Linear(hidden, hv * dv, bias=False)
        self.in_proj_b = nn.Linear(hidden, hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, hv, bias=False)

    def _split(self, h: torch.Tensor):
        """q, k [B, T, Hk, Dk], v, z [B, T, Hv, Dv], b, a [B, T, Hv]."""
        q, k, v = self.in_proj_qkv(h).split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        z = self.in_proj_z(h).unflatten(-1, (self.hv, self.dv))
        q, k, v = (
            q.unflatten(-1, (self.hk, self.dk)),
            k.unflatten(-1, (self.hk, self.dk)),
            v.unflatten(-1, z.shape[-2:]),
        )
        return q, k, v, z, self.in_proj_b(h), self.in_proj_a(h)


# its decode step in one C call (accel/mixers/delta.py): [q | k | v] from one projection, one conv
QWEN35_DELTA = DeltaForm(qkv=("in_proj_qkv",), convs=("conv1d",), z=("in_proj_z",), b="in_proj_b", a=("in_proj_a",))
register_accel(Qwen35GatedDeltaNet, delta_accel(Qwen35GatedDeltaNet, QWEN35_DELTA))


class Qwen35DecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3-Next's decoder layer with Qwen3.5's delta mixer and a dense MLP everywhere."""

    delta_mixer = Qwen35GatedDeltaNet

    def __init__(self, cfg: Qwen35Config, kind: str, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, kind, rotary, moe=False)


@register_family("qwen3_5_text")
class Qwen35LM(StackLM):
    family = "qwen3_5"
    config_class = Qwen35Config
    layer_class = Qwen35DecoderLayer  # StackLM's defaults: plan() = layer_types, build_layer(), the final norm
    final_norm_options = {"unit_offset": True}

    def shared(self) -> RotaryEmbedding:
        rope = {k: v for k, v in self.cfg.rope().items() if not k.startswith("mrope")}  # text: MRoPE = RoPE
        return RotaryEmbedding(*rope_frequencies(self.cfg.to_dict(), rope, self.cfg.rotary_dim()))

    def native_layers(self) -> list[NativeLayer]:
        return delta_native_layers(self.cfg, self.kinds, self.dtype)

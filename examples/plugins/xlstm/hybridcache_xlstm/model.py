"""xLSTM (HF `xlstm`): pre-norm blocks of an mLSTM layer (matrix memory; soft-capped exponential input and sigmoid
forget gates) and a gated FFN, then a soft-capped head. Each layer's history is its `mlstm` state (state.py, with its
per-token update `mlstm_step`). HF runs long prompts chunkwise and the rest step by step (equal in exact arithmetic);
this family steps token by token."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import FamilyConfig, param
from hybridcache.models.core.registry import register_family
from hybridcache.nn import RMSNorm, StepInput
from hybridcache_xlstm.state import mlstm_step


@dataclass(kw_only=True)
class XLSTMConfig(FamilyConfig):
    """HF xLSTMConfig fields the model reads, with HF defaults (kernel and mode fields do not change the math)."""

    family: ClassVar[str] = "xlstm"
    vocab_size: int = param(50304, positive=True)
    hidden_size: int = param(4096, positive=True, aliases=("embedding_dim",))
    num_hidden_layers: int = param(32, positive=True, aliases=("num_blocks",))
    num_heads: int = param(8, positive=True)
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    use_bias: bool = False
    norm_eps: float = param(1e-6, positive=True)
    eps: float = param(1e-6, positive=True)
    qk_dim_factor: float = param(0.5, positive=True)
    v_dim_factor: float = param(1.0, positive=True)
    ffn_proj_factor: float = param(2.667, positive=True)
    ffn_round_up_to_multiple_of: int = param(64, positive=True)
    gate_soft_cap: float = param(15.0, positive=True)
    output_logit_soft_cap: float = param(30.0, positive=True)
    weight_mode: str = param("single", choices=("single",))  # "fused" stores the same weights concatenated

    def __post_init__(self) -> None:
        super().__post_init__()
        self.qk_dim, self.v_dim = int(self.hidden_size * self.qk_dim_factor), int(self.hidden_size * self.v_dim_factor)

    def problems(self) -> list[str]:
        out = [] if not self.use_bias else ["use_bias: true is not supported (no xLSTM checkpoint uses it)"]
        for name, dim in (("qk", self.qk_dim), ("v", self.v_dim)):
            if dim % self.num_heads:
                out.append(f"the {name} width ({dim}) must be a multiple of num_heads ({self.num_heads})")
        return out


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


class MLSTMLayer(nn.Module):
    """q, k, v, output gate and per-head i / f gates -> mLSTM -> per-head LayerNorm * sigmoid(o) -> out_proj."""

    def __init__(self, cfg: XLSTMConfig) -> None:
        super().__init__()
        d, h, self.heads, self.cfg = cfg.hidden_size, cfg.num_heads, cfg.num_heads, cfg
        for name, width, bias in (("q", cfg.qk_dim, False), ("k", cfg.qk_dim, False), ("v", cfg.v_dim, False),
                                  ("ogate_preact", cfg.v_dim, False), ("igate_preact", h, True),
                                  ("fgate_preact", h, True)):  # fmt: skip
            setattr(self, name, nn.Linear(d, width, bias=bias))
        self.multihead_norm = nn.Module()
        self.multihead_norm.weight = nn.Parameter(torch.ones(cfg.v_dim))
        self.out_proj = nn.Linear(cfg.v_dim, d, bias=False)

    def forward(self, x: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        t, s = x.shape[1], layer.states
        sd = s["C"].dtype
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).to(sd) for p in (self.q, self.k, self.v))  # [B, T, H, D]
        i, f = (soft_cap(p(x), self.cfg.gate_soft_cap).to(sd) for p in (self.igate_preact, self.fgate_preact))
        if not step.all_real:  # [B, T, H]: padding writes nothing and forgets nothing
            i, f = i.masked_fill(~step.valid[..., None], -math.inf), f.masked_fill(~step.valid[..., None], math.inf)
        state, outs, trail = (s["C"], s["n"], s["m"]), [], []
        keep = layer.trail_length(t)  # rollback on: the states after the block's last `keep` interior tokens
        for j in range(t):
            o, state = mlstm_step(*state, q[:, j], k[:, j], v[:, j], i[:, j], f[:, j], self.cfg.eps)
            outs.append(o)
            if t - 1 - keep <= j < t - 1:
                trail.append(state)
        extra = {"trail": {n: torch.stack(z, 1) for n, z in zip("Cnm", zip(*trail), strict=True)}} if keep else {}
        layer.update(**dict(zip("Cnm", state, strict=True)), **extra)
        y = torch.stack(outs, 1).float()  # [B, T, H, Dv]: LayerNorm per head in float32
        y = (y - y.mean(-1, keepdim=True)) * torch.rsqrt(y.var(-1, keepdim=True, unbiased=False) + self.cfg.norm_eps)
        y = y.to(x.dtype).flatten(2) * self.multihead_norm.weight
        return self.out_proj(torch.sigmoid(self.ogate_preact(x)) * y)


class XLSTMBlock(nn.Module):
    """h + mlstm(norm_mlstm(h)), then h + ffn(norm_ffn(h)); the FFN is silu(proj_up_gate) * proj_up -> proj_down."""

    def __init__(self, cfg: XLSTMConfig) -> None:
        super().__init__()
        d, mult = cfg.hidden_size, cfg.ffn_round_up_to_multiple_of
        up = int(math.ceil(d * cfg.ffn_proj_factor / mult) * mult)
        self.norm_mlstm, self.norm_ffn = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.mlstm_layer = MLSTMLayer(cfg)
        self.ffn = nn.Module()
        self.ffn.proj_up_gate, self.ffn.proj_up = nn.Linear(d, up, bias=False), nn.Linear(d, up, bias=False)
        self.ffn.proj_down = nn.Linear(up, d, bias=False)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h = h + self.mlstm_layer(self.norm_mlstm(h), layer, step)
        x, ffn = self.norm_ffn(h), self.ffn
        return h + ffn.proj_down(F.silu(ffn.proj_up_gate(x)) * ffn.proj_up(x))


@register_family("xlstm")
class XLSTMLM(HybridLM):
    family = "xlstm"
    config_class = XLSTMConfig
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: Mapping[str, Any] | XLSTMConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.backbone.blocks = nn.ModuleList(XLSTMBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.backbone.out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.blocks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)  # [B, T, D]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(self.backbone.out_norm(h)), self.cfg.output_logit_soft_cap)  # [B, T, V]

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        shape = {"num_heads": c.num_heads, "qk_head_dim": c.qk_dim // c.num_heads, "v_head_dim": c.v_dim // c.num_heads}
        return [NativeLayer("mlstm", {**shape, "dtype": self.dtype}) for _ in range(c.num_hidden_layers)]

"""Gemma3 text model: sliding-window and full attention layers, sandwich norms, q/k norms, scaled embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel.kernel_calls import takes
from hybridcache.blocks import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.blocks.attention.rotary import rope_frequencies
from hybridcache.blocks.fast.decode_run import embedding_form, head_form
from hybridcache.blocks.fast.decoder_tail import bound_tail, decoder_tail
from hybridcache.blocks.fast.kernel_memo import KernelMemo
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM

NATIVE_TYPE = {"sliding_attention": "sliding", "full_attention": "full"}


@dataclass(kw_only=True)
class Gemma3Config(AttentionFields):
    """HF Gemma3TextConfig (transformers 5) fields the model reads, with HF defaults. `rope_theta` and
    `rope_local_base_freq` (older configs) apply to full / sliding layers when `rope_parameters` is absent."""

    family: ClassVar[str] = "gemma3"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(4, positive=True)
    head_dim: int = param(256, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = param(1e-6, positive=True)
    max_position_embeddings: int = param(131_072, positive=True)
    rope_theta: float = param(1_000_000.0, positive=True)
    rope_local_base_freq: float = param(10_000.0, positive=True)
    query_pre_attn_scalar: int | float = param(256, positive=True)
    sliding_window: int | None = param(4096, positive=True)
    sliding_window_pattern: int = param(6, positive=True, aliases=("_sliding_window_pattern",))
    layer_types: list[str] | None = param(None, choices=tuple(NATIVE_TYPE))  # else from sliding_window_pattern
    final_logit_softcapping: float | None = param(None, nonnegative=True)
    attn_logit_softcapping: float | None = param(None, nonnegative=True)

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.sliding_window is None and "sliding_attention" in self.types:
            out.append("sliding_window is null but there are sliding_attention layers")
        return out

    @property
    def types(self) -> list[str]:
        """Per layer: `layer_types`, else every `sliding_window_pattern`-th layer full, the others sliding."""
        if self.layer_types:
            return list(self.layer_types)
        pattern = self.sliding_window_pattern
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(self.num_hidden_layers)
        ]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, head_dim = cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim
        self.self_attn = AttentionMixer(
            **cfg.attention_mixer_args(),
            scale=cfg.query_pre_attn_scalar**-0.5,
            softcap=cfg.attn_logit_softcapping,
            rotary=rotary,
            q_norm=RMSNorm(head_dim, eps, unit_offset=True),
            k_norm=RMSNorm(head_dim, eps, unit_offset=True),
        )
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_activation)
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self._tail_memo = KernelMemo()  # the bound decoder-tail kernel call of eager decode steps

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        reserved = None
        if h.shape[1] == 1 and takes(h) and not torch.compiler.is_compiling():  # eager decode: one call per layer
            tail = self._bound_tail(h)
            if tail is not None:
                out, reserved = self.self_attn.one_call_step(h, layer, step, self.input_layernorm, tail)
                if out is not None:
                    return out
                reserved = reserved or False  # tried: the separate path writes a reserved slot
        return self.separate(h, layer, step, reserved)

    def decode_binding(self, x: torch.Tensor, layer: CacheLayer):
        """This layer's whole decode step bound to its modules for inputs like x [B, 1, D] (AttentionMixer.step_binding
        with its input norm and bound tail), or None where the kernels do not take them."""
        tail = self._bound_tail(x)
        return None if tail is None else self.self_attn.step_binding(x, layer, self.input_layernorm, tail)

    def decode_record(self, x: torch.Tensor, y: torch.Tensor, layer: CacheLayer, step: StepInput, binding=None):
        """This layer's eager decode step as a record for one C call over many layers (blocks/fast/decode_stack.py):
        AttentionMixer.step_record by `binding` (decode_binding's, for these modules; None: bind it here)."""
        run = self.decode_binding(x, layer) if binding is None else binding
        return None if run is None else self.self_attn.step_record(x, y, layer, step, None, None, run)

    def decode_rotary(self):
        """The rotary embedding whose tables decode_record's call reads (None: none): a decode that runs many steps
        on one record (blocks/fast/decode_run.py) computes them for each step's positions."""
        return self.self_attn.rotary

    def separate(self, h: torch.Tensor, layer: CacheLayer, step: StepInput, reserved=None) -> torch.Tensor:
        """The layer by separate calls; `reserved`: the slot one_call_step / decode_record reserved (False: tried,
        none), which the attention then writes."""
        attn, post, pre = self.self_attn, self.post_attention_layernorm, self.pre_feedforward_layernorm
        a = attn(h, layer, step, project=False, norm=self.input_layernorm, reserved=reserved)  # [B, T, Hq * D]
        out = decoder_tail(h, a, attn.o_proj, post, pre, self.mlp, self.post_feedforward_layernorm, self._tail_memo)
        if out is not None:  # a float32 CPU decode step: the rest of the layer in one kernel call
            return out
        h, x = residual_norm(h, attn.o_proj(a), post, pre)
        return residual_norm(h, self.mlp(x), self.post_feedforward_layernorm, None)[0]

    def _bound_tail(self, h: torch.Tensor):
        attn = self.self_attn
        return bound_tail(
            h.shape[2], attn.num_heads * attn.head_dim, attn.o_proj, self.post_attention_layernorm,
            self.pre_feedforward_layernorm, self.mlp, self.post_feedforward_layernorm, self._tail_memo,
        )  # fmt: skip


@register_family("gemma3_text")
class Gemma3LM(StackLM):
    family = "gemma3"
    config_class = Gemma3Config

    def plan(self) -> list[str]:
        return self.cfg.types

    def shared(self) -> dict[str, RotaryEmbedding]:
        """One rotary embedding per layer kind: sliding layers use `rope_local_base_freq` unless rope_parameters
        names theirs."""
        cfg, rope, rotary = self.cfg, self.cfg.rope_parameters or {}, {}
        for kind in set(self.kinds):
            params = rope.get(kind) or {
                "rope_type": "default",
                "rope_theta": cfg.rope_local_base_freq if kind == "sliding_attention" else cfg.rope_theta,
            }
            rotary[kind] = RotaryEmbedding(*rope_frequencies(cfg.to_dict(), params, cfg.head_dim))
        return rotary

    def build_layer(self, kind: str, index: int, shared: dict[str, RotaryEmbedding]) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(self.cfg, shared[kind])

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, unit_offset=True)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
        # only the sliding layers have a window: a type that takes one (sink, a score-based method over a window)
        # must not inherit it on a global layer
        return [
            NativeLayer(
                NATIVE_TYPE[t], {**attn, "window": c.sliding_window} if NATIVE_TYPE[t] == "sliding" else dict(attn)
            )
            for t in self.types
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=h.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)
        cap = self.cfg.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits

    def decode_embedding(self):
        """`embed` as data, for a decode run that embeds in C (blocks/fast/decode_run.py): (the table, its row scale,
        the
        multiplier; see embedding_form), or None."""
        form = embedding_form(self.model.embed_tokens) if type(self).embed is Gemma3LM.embed else None
        if form is None:
            return None
        return (*form, float(torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=torch.float32)))

    def decode_head(self):
        """`head` as data, for a decode run that computes it in C (blocks/fast/decode_run.py head_form), or None (a
        softcap, or another head)."""
        if type(self).head is not Gemma3LM.head or self.cfg.final_logit_softcapping:
            return None
        return head_form(getattr(self.model, self.final_norm_name), self.lm_head)

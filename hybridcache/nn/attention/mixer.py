"""Grouped-query attention mixer: projections, rotary, the mixer's own attention cache layer, masked attention,
output. The reference computation only; the CPU fast path (hybridcache.accel) plugs in through `accel`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from hybridcache.cache import AttentionCacheLayer
from hybridcache.cache.attention.view import AttentionView
from hybridcache.cache.methods.scored_eviction import QueryInputs
from hybridcache.nn.attention.rotary import RotaryEmbedding
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.linear_group import LinearGroup
from hybridcache.nn.core.norms import kernel_args, kernel_plain
from hybridcache.ops import kernels, masked_attention
from hybridcache.ops.attention import pattern_attention


class AttentionMixer(nn.Module):
    """q/k/v/o projections (HF names), optional per-head q/k norms, rotary, scale and softcap.

    `query_hook(q, step)` lets a family rescale queries by position (Llama4 attention temperature).
    `output_gate=True` (Qwen3-Next): q_proj also yields a per-head gate, laid out per head as [query | gate], and
    the attention output is multiplied by sigmoid(gate) before o_proj.
    `out_hidden` (Zamba2): o_proj writes this width instead of `hidden` (its shared attention reads [h, embeddings]).
    `forward(..., extra=(q, k, v))` adds per-call terms to the projections, [B, T, H*D] each or None (Zamba2's
    per-use LoRA adapters on one shared attention).
    `sinks=True` (GPT-OSS, GraniteSWA): a learned logit per query head, `sinks` [Hq], in every softmax denominator
    (a model parameter, not cache state), which the decode kernel takes too.

    `accel`: the fast path hybridcache.accel installed on this mixer (None: none); `forward` offers it each call
    first and runs the reference below where it declines.
    """

    # q / k / v are the plain projections (+ plain q / k norms, rotary) the fused kernels compute; a subclass that
    # projects its own way (MLA, OLMo hybrid) says False, and the fast path leaves its projection alone
    plain_projection: ClassVar[bool] = True

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        rotary: RotaryEmbedding | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        query_hook: Callable[[torch.Tensor, StepInput], torch.Tensor] | None = None,
        output_gate: bool = False,
        out_hidden: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden, num_heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_hidden or hidden, bias=o_bias)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap, self.rotary, self.query_hook = softcap, rotary, query_hook
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # [Hq]
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)  # one matmul once fused (from_pretrained)
        self.accel = None  # hybridcache.accel's fast path for this mixer, once installed

    def projection_groups(self) -> list[LinearGroup]:
        return [self.qkv]

    def _plain(self) -> bool:
        """Whether the q / k norms and the rotary are the plain kinds the kernels compute (or none): float32
        RMSNorms, RotaryEmbedding."""
        plain_rotary = self.rotary is None or type(self.rotary) is RotaryEmbedding
        return kernel_plain(self.q_norm) and kernel_plain(self.k_norm) and plain_rotary

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, step: StepInput) -> tuple[torch.Tensor, ...] | None:
        """The plain RMSNorm q/k norms and plain rotary of this mixer by the norm-rope kernel; None when either is
        another kind (Llama4's L2 norm after its rotary, say), or when the kernel does not take these tensors."""
        if (
            (self.q_norm is None and self.rotary is None)
            or not self._plain()
            or not kernels.takes(q)
            or not kernels.takes(k)
        ):
            return None
        cos = sin = None
        if self.rotary is not None:
            cos, sin = self.rotary.tables(step, q.dtype)
            if not self.rotary.kernel_tables(q, cos):
                return None
        out = []
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            y = kernels.call(
                "norm_rope", x, *kernel_args(norm), cos, sin, self.rotary is not None and self.rotary.interleaved
            )
            if y is None:
                return None
            out.append(y)
        return tuple(out)

    def _project(self, h: torch.Tensor, step: StepInput, extra, prerope: bool = False) -> tuple[torch.Tensor, ...]:
        """q [B, Hq, T, D], k and v [B, Hkv, T, D] (q/k normed and rotated), the output gate (or None) and, with
        `prerope`, q before rotary (else None), by the separate calls."""
        b, t, _ = h.shape
        d = self.head_dim
        qp, kp, vp = self.qkv(h)  # [B, T, H * D] each
        if extra is not None:
            qp, kp, vp = (p if e is None else p + e for p, e in zip((qp, kp, vp), extra, strict=True))
        gate = None
        if self.output_gate:  # per head: [query (D) | gate (D)]
            q, gate = qp.view(b, t, self.num_heads, 2 * d).chunk(2, dim=-1)
            q, gate = q.transpose(1, 2), gate.reshape(b, t, self.num_heads * d)  # [B, Hq, T, D], [B, T, Hq * D]
        else:
            q = qp.view(b, t, self.num_heads, d).transpose(1, 2)  # [B, Hq, T, D]
        k = kp.view(b, t, self.num_kv_heads, d).transpose(1, 2)  # [B, Hkv, T, D]
        v = vp.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        fused = None if prerope else self._norm_rope(q, k, step)  # float32 CPU: norms + rotary, one kernel call each
        q_pre = None
        if fused is not None:
            q, k = fused
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q_pre = q if prerope else None
            if self.rotary is not None:
                q, k = self.rotary(q, k, step)  # cos/sin computed once per block and frequency table
        return q, k, v, gate, q_pre

    def forward(
        self,
        h: torch.Tensor,
        layer: AttentionCacheLayer,
        step: StepInput,
        extra: tuple[torch.Tensor | None, ...] | None = None,
        project: bool = True,
        norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """[B, T, out] from h [B, T, hidden] (through `norm` first, the layer's input norm, unless None); with
        `project=False` the output before o_proj, [B, T, Hq * D]."""
        if self.accel is not None and extra is None:
            out = self.accel(h, layer, step, norm, project)  # the fast path, where it takes this call
            if out is not None:
                return out
        return self.reference(h, layer, step, extra, project, norm)

    def reference(
        self,
        h: torch.Tensor,
        layer: AttentionCacheLayer,
        step: StepInput,
        extra: tuple[torch.Tensor | None, ...] | None = None,
        project: bool = True,
        norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """`forward` by the reference computation (the fast path not offered)."""
        if norm is not None:
            h = norm(h)
        wants_queries = getattr(layer, "wants_queries", False)  # a method modelling future queries (ExpectedAttention)
        q, k, v, gate, q_pre = self._project(h, step, extra, prerope=wants_queries)
        if self.query_hook is not None:
            q = self.query_hook(q, step)
        dtype = layer.spec.dtype
        view = layer.update(k if k.dtype == dtype else k.to(dtype), v if v.dtype == dtype else v.to(dtype))
        return self.attend(q, view, layer, gate, q_pre, project)

    def attend(
        self,
        q: torch.Tensor,
        view: AttentionView,
        layer: AttentionCacheLayer,
        gate: torch.Tensor | None = None,
        q_pre: torch.Tensor | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """Queries q [B, Hq, T, D] (normed, rotated) attending over `view` (what `layer` gave for this block), then
        the output gate [B, T, Hq * D] (None: none) and o_proj unless not `project`: [B, T, out]. q_pre: the queries
        before rotary, for a layer that models future queries."""
        b, _, t, d = q.shape
        keys, values = view.keys, view.values
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        wants_queries = getattr(layer, "wants_queries", False)
        out = None
        if layer.wants_attention_weights or wants_queries:  # score-based eviction reads the block's weights
            out, weights = masked_attention(
                q, keys, values, view.mask, self.scale, self.softcap, return_weights=True, sinks=self.sinks
            )
            if wants_queries:
                rotation = None if self.rotary is None else partial(self.rotary.mean_rotation, head_dim=d)
                layer.observe_attention(weights, QueryInputs(q_pre, rotation, self.scale))
            else:
                layer.observe_attention(weights)
        elif t == 1:  # a decode step: the kernel evaluates the pattern from positions (None: not taken)
            out = pattern_attention(q, keys, values, view.pattern(), self.scale, self.softcap, self.sinks)
        if out is None:
            out = masked_attention(q, keys, values, view.mask, self.scale, self.softcap, sinks=self.sinks)
        out = out.transpose(1, 2).reshape(b, t, -1)  # [B, T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out) if project else out

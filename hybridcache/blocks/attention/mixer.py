"""Grouped-query attention mixer. Masks and keys come from the mixer's own attention cache layer."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from hybridcache.accel.attention_step import bind_attention_step
from hybridcache.accel.checks import MAX_ROWS
from hybridcache.accel.decoder_layer import bind_decoder_layer
from hybridcache.accel.fused import bind_qkv_norm_rope
from hybridcache.accel.kernel_calls import call, takes
from hybridcache.blocks.attention.rotary import RotaryEmbedding
from hybridcache.blocks.core.common import StepInput
from hybridcache.blocks.core.linear_group import LinearGroup
from hybridcache.blocks.core.norms import kernel_args, kernel_key, kernel_plain
from hybridcache.blocks.fast.kernel_memo import KernelMemo, tensor_key
from hybridcache.cache import AttentionCacheLayer
from hybridcache.cache.methods.scored_eviction import QueryInputs
from hybridcache.ops import masked_attention
from hybridcache.ops.attention import decode_kernel


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
    """

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
        self._input_memo = KernelMemo()  # the bound q/k/v kernel call of eager decode steps
        self._step_memo = KernelMemo()  # the bound one-call attention of eager decode steps (q/k/v to output)

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
        if (self.q_norm is None and self.rotary is None) or not self._plain() or not takes(q) or not takes(k):
            return None
        cos = sin = None
        if self.rotary is not None:
            cos, sin = self.rotary.tables(step, q.dtype)
            if not self.rotary.kernel_tables(q, cos):
                return None
        out = []
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            y = call("norm_rope", x, *kernel_args(norm), cos, sin, self.rotary is not None and self.rotary.interleaved)
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

    def _fused_input(self, h: torch.Tensor, step: StepInput, norm: nn.Module | None) -> tuple[torch.Tensor, ...] | None:
        """q, k, v [B, H, T, D] by one kernel call (the input norm `norm` unless None, projection, plain RMSNorm q/k
        norms, plain rotary) for a decode step on CPU; None when this mixer or these tensors need the separate path.
        Eagerly the call is bound once to this mixer's weights and norms (blocks/fast/kernel_memo.py)."""
        if self.output_gate or self.query_hook is not None or not takes(h) or h.dim() != 3:
            return None
        if torch.compiler.is_compiling():
            return self._traced_input(h, step, norm)
        run = self._input_memo.get(self._input_key(h, norm), lambda: self._bind_input(h.shape[2], norm))
        if run is None:
            return None
        cos, sin = self._tables(h, step)
        if cos is False:
            return None
        return run(h, cos, sin)

    def _input_key(self, h: torch.Tensor, norm: nn.Module | None) -> tuple:
        """What a bound q/k/v call relies on (blocks/fast/kernel_memo.py)."""
        qkv, rotary = self.qkv, self.rotary
        f = qkv._fused
        return (
            h.shape[2],
            None if f is None else (id(f[0]), id(f[1]), id(f[2]), f[3] == qkv._pointers()),  # held by the call
            kernel_key(self.q_norm),
            kernel_key(self.k_norm),
            kernel_key(norm),
            type(rotary),
            rotary is not None and rotary.interleaved,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )

    def _tables(self, h: torch.Tensor, step: StepInput) -> tuple:
        """The rotary's cos / sin for the kernels ((None, None): no rotary; (False, False): tables they do not
        take)."""
        rotary = self.rotary
        if rotary is None:
            return None, None
        cos, sin = rotary.tables(step, torch.float32)
        return (cos, sin) if rotary.kernel_tables(h, cos) else (False, False)

    def one_call_step(self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, tail=None):
        """A decode step's attention by one kernel call (accel/attention_step.py): the output before o_proj
        [B, 1, Hq * D], the token's keys and values written straight into the slot `layer` reserved
        (AttentionCacheLayer.decode_slot). With `tail` (the layer's bound decoder tail, blocks/fast/decoder_tail.py
        bound_tail, whose residual is h) the whole layer in that call instead (accel/decoder_layer.py): the
        layer's output [B, 1, D]. Returns (output, None), or (None, reserved) where the separate path runs:
        reserved = (view, slot) when the slot is already reserved (then pass it to forward), else None."""
        return self._one_call_step(h, layer, step, norm, tail)

    def _one_call_step(self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, tail=None):
        got = self._reserve_step(h, layer, step, norm, tail)
        if got is None:
            return None, None
        run, args, reserved = got
        out = run(h, *args)
        return (out, None) if out is not None else (None, reserved)

    def step_record(
        self, x: torch.Tensor, y: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, tail, run=None
    ):
        """one_call_step's whole-layer call (`tail` bound) as a record for a step that runs many layers in one C
        call (blocks/fast/decode_stack.py): x [B, 1, D] the layer's input, y [B, 1, D] where its output goes (neither
        written yet); `run`: the call `step_binding` gave for these modules (None: bind it here). Returns
        (hc_decoder_layer's arguments, the tensors they point into: keep them alive until the call), None (nothing
        reserved: run the layer as usual), or ("reserved", reserved) where the slot is reserved but the kernel does
        not take these tensors (pass it to the separate path once x holds the input)."""
        if run is None:
            run = self.step_binding(x, layer, norm, tail)
        got = None if run is None else self._reserve_with(run, x, layer, step)
        if got is None:
            return None
        run, args, reserved = got
        recorded = run.record(x, y, *args)
        return recorded if recorded is not None else ("reserved", reserved)

    def _reserve_step(self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, tail):
        """(the bound one-call attention, or whole layer with `tail`; its arguments after h; the reservation) with
        the token's slot reserved in `layer`, or None (nothing reserved) where this mixer, layer or step does not
        take it."""
        run = self.step_binding(h, layer, norm, tail)
        return None if run is None else self._reserve_with(run, h, layer, step)

    def step_binding(self, h: torch.Tensor, layer, norm: nn.Module | None, tail):
        """The one-call attention (whole layer with `tail`) bound to this mixer's modules for inputs like h, or None
        where they, h or `layer` do not take it. Depends on the modules and h's shape and dtype only: a decode that
        knows the modules stay as they are may keep it across steps (blocks/fast/decode_stack.py `steady`)."""
        if (
            self.output_gate
            or self.query_hook is not None
            or not takes(h)
            or h.dim() != 3
            or h.shape[1] != 1
            or not 0 < h.shape[0] <= MAX_ROWS
            or torch.compiler.is_compiling()
            or not isinstance(layer, AttentionCacheLayer)
            or type(self)._project is not AttentionMixer._project  # a subclass that projects its own way (MLA)
            or type(self)._fused_input is not AttentionMixer._fused_input
        ):
            return None
        key = (self._input_key(h, norm), self.scale, self.softcap, tensor_key(self.sinks), id(tail))
        if tail is None:
            return self._step_memo.get(key, lambda: self._bind_step(h.shape[2], norm))
        # (the bound call holds `tail`, so its id is not reused while this entry is kept)
        return self._step_memo.get(key, lambda: bind_decoder_layer(self._bind_step(h.shape[2], norm), tail))

    def _reserve_with(self, run, h: torch.Tensor, layer, step: StepInput):
        """_reserve_step's reservation for a bound call: (run, its arguments after h, the reservation), or None
        (nothing reserved)."""
        if not isinstance(layer, AttentionCacheLayer):
            return None
        cos, sin = self._tables(h, step)
        if cos is False:
            return None
        reserved = layer.decode_slot()
        if reserved is None:
            return None
        view, slot = reserved
        qpos, kpos, kind, param = view.pattern()  # (decode_slot: a built-in pattern, positions per row)
        return run, (cos, sin, view.keys, view.values, slot, qpos, kpos, kind, param), reserved

    def _bind_step(self, dm: int, norm: nn.Module | None):
        """The one-call attention bound to this mixer's projection, norms, scale, softcap and sinks (None: the
        kernel does not take them)."""
        args = self._kernel_args(dm, norm)
        return None if args is None else bind_attention_step(*args, self.scale, self.softcap, self.sinks)

    def _bind_input(self, dm: int, norm: nn.Module | None):
        """The q/k/v kernel call bound to this mixer's fused projection and norms (None: the kernel does not take
        them)."""
        args = self._kernel_args(dm, norm)
        return None if args is None else bind_qkv_norm_rope(*args)

    def _kernel_args(self, dm: int, norm: nn.Module | None) -> tuple | None:
        """The q/k/v kernels' arguments for this mixer (bind_qkv_norm_rope's; bind_attention_step's start so):
        None when its projection is not fused or a norm / the rotary is not a kind they compute."""
        parts = self.qkv.parts()
        if parts is None or not self._plain() or not kernel_plain(norm):
            return None
        qn, kn, rotary = self.q_norm, self.k_norm, self.rotary
        return (
            parts,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            dm,
            None if qn is None else kernel_args(qn),
            None if kn is None else kernel_args(kn),
            rotary is not None and rotary.interleaved,
            None if norm is None else kernel_args(norm),
        )

    def _traced_input(
        self, h: torch.Tensor, step: StepInput, norm: nn.Module | None
    ) -> tuple[torch.Tensor, ...] | None:
        """_fused_input under torch.compile: the registered op on the flat arguments."""
        if not self._plain() or not kernel_plain(norm):
            return None
        parts = self.qkv.parts()
        if parts is None:
            return None
        qn, kn, rotary = self.q_norm, self.k_norm, self.rotary
        cos, sin = rotary.tables(step, torch.float32) if rotary is not None else (None, None)
        if rotary is not None and not rotary.kernel_tables(h, cos):
            return None
        return call(
            "qkv_norm_rope",
            h,
            *parts,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            *kernel_args(qn),
            *kernel_args(kn),
            cos,
            sin,
            rotary is not None and rotary.interleaved,
            *kernel_args(norm),
        )

    def forward(
        self,
        h: torch.Tensor,
        layer: AttentionCacheLayer,
        step: StepInput,
        extra: tuple[torch.Tensor | None, ...] | None = None,
        project: bool = True,
        norm: nn.Module | None = None,
        reserved: tuple | bool | None = None,
    ) -> torch.Tensor:
        """[B, T, out] from h [B, T, hidden] (through `norm` first, the layer's input norm, unless None: a plain
        RMSNorm runs in the q/k/v kernel call); with `project=False` the output before o_proj, [B, T, Hq * D] (for a
        caller that runs o_proj in a fused kernel: blocks/fast/decoder_tail.py). `reserved`: what one_call_step returned
        when the caller tried it first ((view, slot) to write, or False: nothing reserved; None: not tried)."""
        b, t, _ = h.shape
        d = self.head_dim
        gate = q_pre = None
        wants_queries = getattr(layer, "wants_queries", False)  # a method modelling future queries (ExpectedAttention)
        if reserved is None and t == 1 and extra is None and not wants_queries:  # eager decode: one kernel call
            out, reserved = self._one_call_step(h, layer, step, norm)
            if out is not None:
                return self.o_proj(out) if project else out
        reserved = reserved or None
        fused_input = self._fused_input(h, step, norm) if extra is None and not wants_queries else None
        if fused_input is not None:
            q, k, v = fused_input
        else:
            if norm is not None:
                h = norm(h)
            q, k, v, gate, q_pre = self._project(h, step, extra, prerope=wants_queries)
        if self.query_hook is not None:
            q = self.query_hook(q, step)
        dtype = layer.spec.dtype
        k, v = k if k.dtype == dtype else k.to(dtype), v if v.dtype == dtype else v.to(dtype)
        if reserved is not None:  # the slot the one-call step did not fill after all
            view, slot = reserved
            view.keys.narrow(2, slot, 1).copy_(k)
            view.values.narrow(2, slot, 1).copy_(v)
        else:
            view = layer.update(k, v)
        keys, values = view.keys, view.values
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
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
        elif t == 1 and decode_kernel(q, keys, values, self.sinks):  # a decode step: the kernel reads positions
            pattern = view.pattern()
            if pattern is not None and pattern[1].dim() == 2:  # (per-head positions: by the mask below)
                qpos, kpos, kind, param = pattern
                out = call(
                    "decode_attention",
                    q,
                    keys,
                    values,
                    None,
                    qpos,
                    kpos,
                    kind,
                    param,
                    self.scale,
                    self.softcap,
                    self.sinks,
                )
        if out is None:
            out = masked_attention(q, keys, values, view.mask, self.scale, self.softcap, sinks=self.sinks)
        out = out.transpose(1, 2).reshape(b, t, -1)  # [B, T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out) if project else out

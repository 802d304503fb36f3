"""The fast path of one AttentionMixer (`mixer.accel`, installed by accel.install): its calls bound to the mixer's
weights and norms.

- A decode step (one token per row) by one kernel call (native/steps/attention.py): input norm, q / k / v, q / k norms,
  rotary, the token's keys and values written straight into the slot the cache layer reserves
  (`AttentionSlots.decode_slot`), attention. With a decoder layer's bound tail (decoder_tail.py) the whole layer
  (decoder_layer.py), or the same as a record for a C call over many layers (layer_records.py).
- Any other block whose projection the kernels compute: q / k / v by one kernel call (input norm, fused projection,
  q / k norms, rotary), then the mixer's own `attend`.
Everything else, and anything a kernel declines before a slot is reserved, is the mixer's reference forward (the
hook returns None). A slot reserved and then declined is written here from the mixer's reference projection.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.kernel_memo import KernelMemo, norm_key, tensor_key
from hybridcache.accel.native.checks import MAX_ROWS
from hybridcache.accel.native.decoder_layer import bind_decoder_layer
from hybridcache.accel.native.fused import bind_qkv_norm_rope
from hybridcache.accel.native.kernel_calls import call, takes
from hybridcache.accel.native.steps.attention import bind_attention_step
from hybridcache.accel.slots import AttentionSlots, SlotView
from hybridcache.cache import AttentionCacheLayer
from hybridcache.nn.attention.mixer import AttentionMixer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import kernel_args, kernel_plain


class AttentionAccel:
    """`mixer.accel`: called by AttentionMixer.forward as accel(h, layer, step, norm, project); None: not taken."""

    def __init__(self, mixer: AttentionMixer) -> None:
        self.mixer = mixer
        self.input_memo = KernelMemo()  # the bound q/k/v kernel call of eager steps
        self.step_memo = KernelMemo()  # the bound one-call attention (or whole layer) of eager decode steps

    def __call__(
        self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, project: bool
    ) -> torch.Tensor | None:
        """The mixer's forward(h, layer, step, project=project, norm=norm) by the kernels, or None (nothing done:
        the reference runs)."""
        reserved = None
        if h.shape[1] == 1 and not getattr(layer, "wants_queries", False):  # eager decode: one kernel call
            out, reserved = self.one_call_step(h, layer, step, norm)
            if out is not None:
                return self.mixer.o_proj(out) if project else out
        return self.separate(h, layer, step, norm, project, reserved)

    def separate(
        self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, project: bool, reserved=None
    ) -> torch.Tensor | None:
        """The mixer's forward with q / k / v by one kernel call where it takes them, writing the slot `reserved`
        ((view, slot) that one_call_step reserved and did not fill) instead of feeding the layer; None (nothing
        done) where there is no reserved slot and the kernel does not take the input."""
        mixer = self.mixer
        if reserved is None and getattr(layer, "wants_queries", False):  # it reads the queries before rotary
            return None
        qkv = self.fused_input(h, step, norm)
        if qkv is None and reserved is None:
            return None
        gate = None
        if qkv is not None:
            q, k, v = qkv
        else:
            q, k, v, gate, _ = mixer._project(h if norm is None else norm(h), step, None)
        if mixer.query_hook is not None:
            q = mixer.query_hook(q, step)
        dtype = layer.spec.dtype
        k, v = k if k.dtype == dtype else k.to(dtype), v if v.dtype == dtype else v.to(dtype)
        if reserved is not None:  # the slot the one-call step did not fill after all
            view, slot = reserved
            view.keys.narrow(2, slot, 1).copy_(k)
            view.values.narrow(2, slot, 1).copy_(v)
        else:
            view = layer.update(k, v)
        return mixer.attend(q, view, layer, gate, None, project)

    # -- q / k / v by one kernel call ---------------------------------------------------------------------------
    def fused_input(self, h: torch.Tensor, step: StepInput, norm: nn.Module | None) -> tuple[torch.Tensor, ...] | None:
        """q, k, v [B, H, T, D] by one kernel call (the input norm `norm` unless None, projection, plain RMSNorm q/k
        norms, plain rotary) on CPU; None when this mixer or these tensors need the separate path. Eagerly the call
        is bound once to this mixer's weights and norms (kernel_memo.py)."""
        mixer = self.mixer
        if (
            not mixer.plain_projection
            or mixer.output_gate
            or mixer.query_hook is not None
            or not takes(h)
            or h.dim() != 3
        ):
            return None
        if torch.compiler.is_compiling():
            return self._traced_input(h, step, norm)
        run = self.input_memo.get(self._input_key(h, norm), lambda: self._bind_input(h.shape[2], norm))
        if run is None:
            return None
        cos, sin = self._tables(h, step)
        if cos is False:
            return None
        return run(h, cos, sin)

    def _input_key(self, h: torch.Tensor, norm: nn.Module | None) -> tuple:
        """What a bound q/k/v call relies on (kernel_memo.py)."""
        mixer = self.mixer
        qkv, rotary = mixer.qkv, mixer.rotary
        f = qkv._fused
        return (
            h.shape[2],
            None if f is None else (id(f[0]), id(f[1]), id(f[2]), f[3] == qkv._pointers()),  # held by the call
            norm_key(mixer.q_norm),
            norm_key(mixer.k_norm),
            norm_key(norm),
            type(rotary),
            rotary is not None and rotary.interleaved,
            mixer.num_heads,
            mixer.num_kv_heads,
            mixer.head_dim,
        )

    def _tables(self, h: torch.Tensor, step: StepInput) -> tuple:
        """The rotary's cos / sin for the kernels ((None, None): no rotary; (False, False): tables they do not
        take)."""
        rotary = self.mixer.rotary
        if rotary is None:
            return None, None
        cos, sin = rotary.tables(step, torch.float32)
        return (cos, sin) if rotary.kernel_tables(h, cos) else (False, False)

    def _bind_input(self, dm: int, norm: nn.Module | None):
        """The q/k/v kernel call bound to this mixer's fused projection and norms (None: the kernel does not take
        them)."""
        args = self._kernel_args(dm, norm)
        return None if args is None else bind_qkv_norm_rope(*args)

    def _kernel_args(self, dm: int, norm: nn.Module | None) -> tuple | None:
        """The q/k/v kernels' arguments for this mixer (bind_qkv_norm_rope's; bind_attention_step's start so):
        None when its projection is not fused or a norm / the rotary is not a kind they compute."""
        mixer = self.mixer
        parts = mixer.qkv.parts()
        if parts is None or not mixer._plain() or not kernel_plain(norm):
            return None
        qn, kn, rotary = mixer.q_norm, mixer.k_norm, mixer.rotary
        return (
            parts,
            mixer.num_heads,
            mixer.num_kv_heads,
            mixer.head_dim,
            dm,
            None if qn is None else kernel_args(qn),
            None if kn is None else kernel_args(kn),
            rotary is not None and rotary.interleaved,
            None if norm is None else kernel_args(norm),
        )

    def _traced_input(
        self, h: torch.Tensor, step: StepInput, norm: nn.Module | None
    ) -> tuple[torch.Tensor, ...] | None:
        """fused_input under torch.compile: the registered op on the flat arguments."""
        mixer = self.mixer
        if not mixer._plain() or not kernel_plain(norm):
            return None
        parts = mixer.qkv.parts()
        if parts is None:
            return None
        qn, kn, rotary = mixer.q_norm, mixer.k_norm, mixer.rotary
        cos, sin = rotary.tables(step, torch.float32) if rotary is not None else (None, None)
        if rotary is not None and not rotary.kernel_tables(h, cos):
            return None
        return call(
            "qkv_norm_rope",
            h,
            *parts,
            mixer.num_heads,
            mixer.num_kv_heads,
            mixer.head_dim,
            *kernel_args(qn),
            *kernel_args(kn),
            cos,
            sin,
            rotary is not None and rotary.interleaved,
            *kernel_args(norm),
        )

    # -- a decode step by one kernel call -----------------------------------------------------------------------
    def one_call_step(self, h: torch.Tensor, layer, step: StepInput, norm: nn.Module | None, tail=None):
        """A decode step's attention by one kernel call (native/steps/attention.py): the output before o_proj
        [B, 1, Hq * D], the token's keys and values written straight into the slot `layer` reserved. With `tail`
        (the layer's bound decoder tail, decoder_tail.py bound_tail, whose residual is h) the whole layer in that
        call instead (decoder_layer.py): the layer's output [B, 1, D]. Returns (output, None), or (None, reserved)
        where the separate path runs: reserved = (view, slot) when the slot is already reserved (then pass it to
        `separate`), else None."""
        run = self.binding(h, layer, norm, tail)
        got = None if run is None else self._reserve_with(run, h, layer, step)
        if got is None:
            return None, None
        run, args, reserved = got
        out = run(h, *args)
        return (out, None) if out is not None else (None, reserved)

    def record(self, x: torch.Tensor, y: torch.Tensor, layer, step: StepInput, run):
        """one_call_step's whole-layer call (`run`: a binding with a tail) as a record for a step that runs many
        layers in one C call (layer_records.py): x [B, 1, D] the layer's input, y [B, 1, D] where its output goes
        (neither written yet). Returns (hc_decoder_layer's arguments, the tensors they point into: keep them alive
        until the call), None (nothing reserved: run the layer as usual), or ("reserved", reserved) where the slot
        is reserved but the kernel does not take these tensors (pass it to the separate path once x holds the
        input)."""
        got = self._reserve_with(run, x, layer, step)
        if got is None:
            return None
        run, args, reserved = got
        recorded = run.record(x, y, *args)
        return recorded if recorded is not None else ("reserved", reserved)

    def binding(self, h: torch.Tensor, layer, norm: nn.Module | None, tail):
        """The one-call attention (whole layer with `tail`) bound to this mixer's modules for inputs like h, or None
        where they, h or `layer` do not take it. Depends on the modules and h's shape and dtype only: a decode that
        knows the modules stay as they are may keep it across steps (layer_records.py `steady`)."""
        mixer = self.mixer
        if (
            not mixer.plain_projection
            or mixer.query_hook is not None
            or not takes(h)
            or h.dim() != 3
            or h.shape[1] != 1
            or not 0 < h.shape[0] <= MAX_ROWS
            or torch.compiler.is_compiling()
            or not isinstance(layer, AttentionCacheLayer)
        ):
            return None
        key = (self._input_key(h, norm), mixer.scale, mixer.softcap, tensor_key(mixer.sinks), id(tail))
        if tail is None:
            return self.step_memo.get(key, lambda: self._bind_step(h.shape[2], norm))
        # (the bound call holds `tail`, so its id is not reused while this entry is kept)
        return self.step_memo.get(key, lambda: bind_decoder_layer(self._bind_step(h.shape[2], norm), tail))

    def _reserve_with(self, run, h: torch.Tensor, layer: AttentionSlots, step: StepInput):
        """(run, its arguments after h, the reservation) with the token's slot reserved in `layer`, or None (nothing
        reserved) where the layer or the rotary's tables do not take it."""
        if not isinstance(layer, AttentionCacheLayer):
            return None
        cos, sin = self._tables(h, step)
        if cos is False:
            return None
        reserved: tuple[SlotView, int] | None = layer.decode_slot()
        if reserved is None:
            return None
        view, slot = reserved
        qpos, kpos, kind, param = view.pattern()  # (decode_slot: a built-in pattern, positions per row)
        return run, (cos, sin, view.keys, view.values, slot, qpos, kpos, kind, param), reserved

    def _bind_step(self, dm: int, norm: nn.Module | None):
        """The one-call attention bound to this mixer's projection, norms, scale, softcap, sinks and output gate
        (hc_gated_attention_step: the gate's sigmoid in C, float32 noise from the reference's; None: the kernel does
        not take them)."""
        mixer = self.mixer
        args = self._kernel_args(dm, norm)
        if args is None:
            return None
        return bind_attention_step(*args, mixer.scale, mixer.softcap, mixer.sinks, mixer.output_gate)

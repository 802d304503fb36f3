"""The fast path of a sandwich-norm decoder layer (nn/core/sandwich.py, Gemma 3; `layer.accel`, installed by
accel.install).

An eager decode step runs the whole layer in one kernel call (decoder_layer.py: the mixer's one-call attention,
then the decoder tail); for a step over many layers it hands that call's arguments back as a record instead
(layer_records.py). Where that does not apply, the attention runs by its own path and everything after it (o_proj,
the residual add between its norms, the gated MLP, its residual add) by one kernel call (decoder_tail.py) where the
kernel takes it. The same kernels in the same order as the separate calls, so the same numbers.
"""

from __future__ import annotations

import torch

from hybridcache.accel.kernel_memo import KernelMemo
from hybridcache.accel.layers.decoder_tail import bound_tail, decoder_tail
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.native.kernel_calls import takes
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import residual_norm
from hybridcache.nn.core.sandwich import SandwichLayer, SandwichParts


class SandwichAccel:
    """`layer.accel`: called by SandwichLayer.forward as accel(h, cache_layer, step); None: not taken."""

    def __init__(self, layer: SandwichLayer) -> None:
        self.layer = layer
        self.tail_memo = KernelMemo()  # the bound decoder-tail kernel call of eager steps

    def __call__(self, h: torch.Tensor, cache_layer, step: StepInput) -> torch.Tensor | None:
        p = self.layer.parts()
        fast = p.attn.accel
        if not isinstance(fast, AttentionAccel):
            return None
        reserved = None
        if h.shape[1] == 1 and takes(h) and not torch.compiler.is_compiling():  # eager decode: one call per layer
            tail = self._tail(h, p)
            if tail is not None:
                out, reserved = fast.one_call_step(h, cache_layer, step, p.input_norm, tail)
                if out is not None:
                    return out
                reserved = reserved or False  # tried: the separate path writes a reserved slot
        return self.separate(h, cache_layer, step, reserved, p)

    def separate(self, h: torch.Tensor, cache_layer, step: StepInput, reserved=None, p: SandwichParts | None = None):
        """The layer by separate calls; `reserved`: the slot the one-call step or a record reserved ((view, slot);
        False: tried, none reserved), which the attention then writes."""
        p = self.layer.parts() if p is None else p
        attn = p.attn
        if reserved is None:  # not tried: the attention's own fast path first
            a = attn(h, cache_layer, step, project=False, norm=p.input_norm)  # [B, T, Hq * D]
        else:
            a = attn.accel.separate(h, cache_layer, step, p.input_norm, False, reserved or None)
            if a is None:
                a = attn.reference(h, cache_layer, step, project=False, norm=p.input_norm)
        out = decoder_tail(h, a, attn.o_proj, p.post_attn, p.pre_mlp, p.mlp, p.post_mlp, self.tail_memo)
        if out is not None:  # a float32 CPU step: the rest of the layer in one kernel call
            return out
        h, x = residual_norm(h, attn.o_proj(a), p.post_attn, p.pre_mlp)
        return residual_norm(h, p.mlp(x), p.post_mlp, None)[0]

    # -- as a record of a many-layer call (layer_records.py, decode_run.py) --------------------------------------
    def binding(self, x: torch.Tensor, cache_layer):
        """This layer's whole decode step bound to its modules for inputs like x [B, 1, D] (AttentionAccel.binding
        with its input norm and bound tail), or None where the kernels do not take them."""
        p = self.layer.parts()
        fast = p.attn.accel
        if not isinstance(fast, AttentionAccel):
            return None
        tail = self._tail(x, p)
        return None if tail is None else fast.binding(x, cache_layer, p.input_norm, tail)

    def record(self, x: torch.Tensor, y: torch.Tensor, cache_layer, step: StepInput, binding=None):
        """This layer's eager decode step as a record for one C call over many layers: AttentionAccel.record by
        `binding` (this object's `binding`, for these modules; None: bind it here)."""
        run = self.binding(x, cache_layer) if binding is None else binding
        return None if run is None else self.layer.parts().attn.accel.record(x, y, cache_layer, step, run)

    def rotary(self):
        """The rotary embedding whose tables the record's call reads (None: none): a decode that runs many steps on
        one record (decode_run.py) computes them for each step's positions."""
        return self.layer.parts().attn.rotary

    def _tail(self, h: torch.Tensor, p: SandwichParts):
        attn = p.attn
        return bound_tail(
            h.shape[2], attn.num_heads * attn.head_dim, attn.o_proj, p.post_attn, p.pre_mlp, p.mlp, p.post_mlp,
            self.tail_memo,
        )  # fmt: skip

"""The fast path of a sandwich-norm decoder layer (LFM3's), as records of a decode step's one C call over many layers
(layer_records.py). Its attention layers are one hc_decoder_layer record (hc_gated_decoder_layer where the attention
is gated), the tail with its post-norms; its conv layers:

    h1 = h + post_mixer(mixer(input_norm(h)))        out = h1 + post_mlp(mlp(pre_mlp(h1)))

three records of csrc/layer_program.c: the input RMSNorm, the mixer's one-call step (recurrent_mixers.py `prepare`)
and hc_sandwich_tail (hc_decoder_tail without its o_proj). The same kernels in the same order as the module calls,
so the same bits; the new states go to the cache by `update` after the call, as pre_norm_layer.py's. The layer names
its parts as a SandwichParts (`layer.sandwich_parts()`, the mixer in the attention's role). A MoE or another MLP, a
norm of another kind, hooks inside the layer or a prefill decline: the module call runs.
"""

from __future__ import annotations

import torch

from hybridcache.accel.layers.decoder_tail import bound_tail
from hybridcache.accel.layers.pre_norm import PreNormAccel, _bind_mlp, _hooked, _Kept, recurrent_records
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.mixers.recurrent import RecurrentAccel
from hybridcache.accel.native.layer_program import CODES, bind_sandwich_tail, record_types, sandwich_tail_args
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import kernel_args, kernel_plain, residual_norm
from hybridcache.nn.core.pre_norm import PreNormParts

_F32 = torch.float32


class SandwichProgramAccel(PreNormAccel):
    """`layer.accel`: `binding` and `record` as layer_records.py asks (registered by the family's model file)."""

    def binding(self, x: torch.Tensor, cache_layer):
        """("recurrent", the mixer's accel, the input norm's (scale, eps), the bound sandwich tail, the records kept
        across steady steps) for inputs like x [B, 1, D]; None where the kernels do not take them."""
        p = self.layer.sandwich_parts()
        if p is None or x.dtype is not _F32 or x.dim() != 3 or record_types() is None:
            return None
        if _hooked(p.input_norm, p.attn, p.post_attn, p.pre_mlp, p.mlp, p.post_mlp):
            return None
        fast = p.attn.__dict__.get("accel")
        norms = (p.input_norm, p.post_attn, p.pre_mlp, p.post_mlp)
        if isinstance(fast, AttentionAccel):  # (an attention layer: one hc_decoder_layer / hc_gated_decoder_layer)
            attn, d = p.attn, x.shape[2]
            width = attn.num_heads * attn.head_dim
            tail = bound_tail(d, width, attn.o_proj, p.post_attn, p.pre_mlp, p.mlp, p.post_mlp, self.tail_memo)
            run = None if tail is None else fast.binding(x, cache_layer, p.input_norm, tail)
            code = CODES["gated_decoder_layer" if attn.output_gate else "decoder_layer"]
            return None if run is None else ("attention", run, code)
        if not isinstance(fast, RecurrentAccel) or p.input_norm is None or not all(map(kernel_plain, norms)):
            return None
        mid = _bind_mlp(x.shape[2], PreNormParts(p.input_norm, p.attn, p.pre_mlp, p.mlp))
        post, post_mlp = (None if n is None else kernel_args(n) for n in (p.post_attn, p.post_mlp))
        tail = None if mid is None or p.mlp is None else bind_sandwich_tail(x.shape[2], post, mid, post_mlp)
        return None if tail is None else ("recurrent", fast, kernel_args(p.input_norm), tail, _Kept())

    def record(self, x: torch.Tensor, y: torch.Tensor, cache_layer, step: StepInput, binding=None):
        """This layer's eager decode step as records: (program, the tensors it points into, (cache layer, the new
        states to hand it after the call)), or None (nothing done: run the module)."""
        bound = self.binding(x, cache_layer) if binding is None else binding
        if bound is None:
            return None
        if bound[0] == "attention":
            got = self.layer.sandwich_parts().attn.accel.record(x, y, cache_layer, step, bound[1])
            if got is None or got[0] == "reserved":
                return got
            return [(bound[2], got[0])], got[1], None
        return recurrent_records(x, y, cache_layer, step, bound, sandwich_tail_args, "sandwich_tail")

    def separate(self, h: torch.Tensor, cache_layer, step: StepInput, reserved):
        """An attention layer by separate calls, its attention writing the slot `record` reserved (a recurrent
        layer reserves none)."""
        p = self.layer.sandwich_parts()
        a = p.attn.accel.separate(h, cache_layer, step, p.input_norm, False, reserved)
        h1, x = residual_norm(h, p.attn.o_proj(a), p.post_attn, p.pre_mlp)
        h2, _ = residual_norm(h1, p.mlp(x), p.post_mlp, None)
        return h2

    def rotary(self):
        """The rotary embedding an attention layer's record reads (None: none, or a recurrent layer)."""
        mixer = self.layer.sandwich_parts().attn
        return mixer.rotary if isinstance(mixer.__dict__.get("accel"), AttentionAccel) else None

"""The fast path of a pre-norm decoder layer (nn/core/pre_norm.py: LFM2, Bamba, Jamba, Mamba, Mamba2, ...; its
`accel`, installed by accel.install) as a record of a decode step's one C call over many layers (layer_records.py).

An attention layer with a gated MLP is a sandwich-norm layer without post-norms: its record is the same
hc_decoder_layer call (AttentionAccel.record with the tail bound to no post-norms); one with no MLP (Nemotron-H's
attention blocks) hc_attention_layer's, of the same record layout. A recurrent layer is three
records of csrc/layer_program.c: the input RMSNorm, the mixer's one-call step (recurrent_mixers.py `prepare`, the
arguments built by native/steps/recurrent.py's checked `*_args`) and the tail (h + y, then the MLP's norm, the gated MLP
and its add; or h + y alone). The same kernels in the same order as the per-layer module calls, so the same bits.

The cache sees a recurrent layer exactly as the per-layer step: the kernel writes the new states into fresh tensors
and, once the C call has run, `layer.update(**states)` hands them to the cache, which commits them with its block
(trails, rollback and state codecs stay the cache's; a failure before that leaves them unseen and the block is
aborted). What the record does not take (a prefill, padding, another dtype, hooks inside the layer, a MoE or
another MLP, a norm of another kind) declines: the layer runs as its module call.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.kernel_memo import KernelMemo
from hybridcache.accel.layers.decoder_tail import bound_attention_tail, bound_tail
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.mixers.recurrent import STEPS, RecurrentAccel, _decode_step
from hybridcache.accel.native.layer_program import CODES, bind_tail, pre_norm_tail_args, record_types, rms_norm_args
from hybridcache.accel.native.op_declarations import ACT_MUL
from hybridcache.accel.native.steps.recurrent import _state
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.linear import DecodeLinear
from hybridcache.nn.core.mlp import GatedMLP
from hybridcache.nn.core.norms import kernel_args, kernel_plain, residual_norm
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts

_F32 = torch.float32
_NO_MLP = CODES["attention_layer"]  # an attention layer's record with no MLP (hc_decoder_layer's layout)


def _hooked(*modules: nn.Module | None) -> bool:
    """Whether a call of these modules (or any module inside them) would run a hook the C call skips."""
    return any(m._forward_hooks or m._forward_pre_hooks for mod in modules if mod is not None for m in mod.modules())


class PreNormAccel:
    """`layer.accel` of a PreNormLayer: `binding`, `record`, `separate` and `rotary`, as layer_records.py asks."""

    def __init__(self, layer: PreNormLayer) -> None:
        self.layer = layer
        self.tail_memo = KernelMemo()  # the bound decoder tail of an attention layer

    def binding(self, x: torch.Tensor, cache_layer):
        """This layer's decode step bound to its modules for inputs like x [B, 1, D]: ("attention", the bound
        whole-layer call) or ("recurrent", the mixer's accel, the input norm's (scale, eps), the bound tail); None
        where the kernels do not take them."""
        p = self.layer.pre_norm_parts()
        if p is None or x.dtype is not _F32 or x.dim() != 3 or _hooked(p.input_norm, p.mixer, p.mlp_norm, p.mlp):
            return None
        fast = p.mixer.__dict__.get("accel")
        if not isinstance(fast, AttentionAccel) and record_types() is None:  # (no program: the module runs)
            return None
        if isinstance(fast, AttentionAccel):
            attn, width = p.mixer, p.mixer.num_heads * p.mixer.head_dim
            if p.mlp is None:  # (Nemotron-H's attention blocks: hc_attention_layer, the record without an MLP)
                if attn.output_gate:  # (no record computes a gated attention without an MLP)
                    return None
                tail, code = bound_attention_tail(x.shape[2], width, attn.o_proj, None, self.tail_memo), _NO_MLP
            else:
                tail = bound_tail(x.shape[2], width, attn.o_proj, None, p.mlp_norm, p.mlp, None, self.tail_memo)
                code = CODES["gated_decoder_layer" if attn.output_gate else "decoder_layer"]
            run = None if tail is None else fast.binding(x, cache_layer, p.input_norm, tail)
            return None if run is None else ("attention", run, code)
        if not isinstance(fast, RecurrentAccel) or p.input_norm is None or not kernel_plain(p.input_norm):
            return None
        tail = _bind_mlp(x.shape[2], p)
        return None if tail is None else ("recurrent", fast, kernel_args(p.input_norm), tail, _Kept())

    def record(self, x: torch.Tensor, y: torch.Tensor, cache_layer, step: StepInput, binding=None):
        """This layer's eager decode step as records of one C call: x [B, 1, D] its input, y [B, 1, D] its output
        (neither written yet). Returns (program [(op code, C arguments)], the tensors they point into, the states to
        hand to the cache after the call (None: none)), ("reserved", reservation) (an attention layer whose slot is
        reserved but whose kernel declined: `separate` runs it), or None (nothing done: run the module)."""
        bound = self.binding(x, cache_layer) if binding is None else binding
        if bound is None:
            return None
        if bound[0] == "attention":
            got = self.layer.pre_norm_parts().mixer.accel.record(x, y, cache_layer, step, bound[1])
            if got is None or got[0] == "reserved":
                return got
            args, alive = got
            return [(bound[2], args)], alive, None
        return recurrent_records(x, y, cache_layer, step, bound, pre_norm_tail_args, "pre_norm_tail")

    def separate(self, h: torch.Tensor, cache_layer, step: StepInput, reserved) -> torch.Tensor:
        """The attention layer by separate calls, its attention writing the slot `record` reserved."""
        p = self.layer.pre_norm_parts()
        attn = p.mixer
        a = attn.accel.separate(h, cache_layer, step, p.input_norm, False, reserved)
        if p.mlp is None:
            return h + attn.o_proj(a)
        h1, x = residual_norm(h, attn.o_proj(a), None, p.mlp_norm)
        return h1 + p.mlp(x)

    def rotary(self):
        """The rotary embedding an attention layer's record reads (None: none, or a recurrent layer)."""
        mixer = self.layer.pre_norm_parts().mixer
        return mixer.rotary if isinstance(mixer.__dict__.get("accel"), AttentionAccel) else None


# a mixer kind's states -> (the record's field of the state it reads, of the new state it writes)
_STATE_FIELDS = {
    "short_conv": {"conv": ("state", "state_out")},
    "mamba2": {"conv": ("conv_state", "conv_out"), "ssm": ("ssm_state", "ssm_out")},
    "mamba": {"conv": ("conv_state", "conv_out"), "ssm": ("ssm_state", "ssm_out")},
    "gated_delta": {"conv": ("conv_state", "conv_out"), "recurrent": ("rec_state", "rec_out")},
    "delta": {"conv": ("conv_state", "conv_out"), "recurrent": ("rec_state", "rec_out")},
    "mamba_groups": {"conv": ("conv_state", "conv_out"), "ssm": ("ssm_state", "ssm_out")},
    "rglru": {"conv": ("conv_state", "conv_out"), "lru": ("lru_state", "lru_out")},  # (and the step's positions)
}


class _Kept:
    """A recurrent layer's records, built by the checked path at the first step of a binding that decode steps
    keep (layer_records.steady: the modules stay as they are), and reused by the later steps: each moves only the
    layer's input and output, its states (checked as the step's `*_args` checks them) and fresh tensors for the new
    states. Outside `steady` every step binds anew, so this stays empty."""

    records = None

    def keep(self, program: list[tuple], kind: str, x: torch.Tensor, news: dict, alive: tuple) -> None:
        types = record_types()
        if types is None or kind not in _STATE_FIELDS:
            return
        self.records = [(op, types[op](*args)) for op, args in program]
        self.alive = alive  # (the buffers the records point into: the norm's output, the mixer's scratch and y)
        self.shape, self.fields, self.kind = x.shape, _STATE_FIELDS[kind], kind
        self.states = {name: t.shape for name, t in news.items()}

    def step(self, x: torch.Tensor, y: torch.Tensor, layer, step: StepInput):
        """record's answer for this step by the kept records; None: they do not take it (the checked path runs)."""
        if not (_decode_step(x, layer, step) and x.shape == self.shape and y.shape == self.shape):
            return None
        if not (x.is_contiguous() and y.is_contiguous() and y.dtype is _F32 and y.is_cpu):
            return None
        states = layer.states
        if states.keys() != self.states.keys():
            return None
        (_, norm), (_, mix), (_, tail) = self.records
        news = {}
        for name, shape in self.states.items():
            t = states[name]
            if not _state(t, tuple(shape), name):
                return None
            new = news[name] = torch.empty(shape, dtype=_F32)
            read, write = self.fields[name]
            setattr(mix, read, t.data_ptr())
            setattr(mix, write, new.data_ptr())
        pos = getattr(step, "positions", None) if self.kind == "rglru" else None  # (where a row's LRU restarts)
        if self.kind == "rglru":
            if not (isinstance(pos, torch.Tensor) and pos.shape == (x.shape[0], 1) and pos.dtype == torch.int64):
                return None
            if not (pos.is_cpu and pos.is_contiguous()):
                return None
            mix.pos = pos.data_ptr()
        norm.x = tail.h = x.data_ptr()
        tail.out = y.data_ptr()
        return self.records, (x, y, states, news, pos), (layer, news)


def recurrent_records(x, y, cache_layer, step: StepInput, bound, tail_args_of, tail_op: str):
    """A recurrent layer's decode step as three records: its input RMSNorm, the mixer's one-call step, and the tail
    (`tail_args_of(x, y_mix, y, tail)` -> (args, what they point into), run as op `tail_op`): (program, the tensors
    it points into, (cache layer, the new states to hand it after the call)), or None (nothing done)."""
    _, fast, (scale, eps), tail, kept = bound
    if kept.records is not None:  # a binding kept across steps: only the states and the buffers move
        got = kept.step(x, y, cache_layer, step)
        if got is not None:
            return got
    xn = torch.empty(x.shape, dtype=_F32)  # the input norm's output, the mixer's input
    got = fast.prepare(xn, cache_layer, step)
    if got is None:
        return None
    kind, args, names = got
    prepared = STEPS[kind][1](*args)
    if prepared is None:
        return None
    c_args, (y_mix, *states), alive = prepared
    norm = rms_norm_args(x, scale, eps, xn)
    tail_args = tail_args_of(x, y_mix, y, tail)
    if norm is None or tail_args is None:
        return None
    program = [(CODES["rms_norm"], norm), (CODES[kind], c_args), (CODES[tail_op], tail_args[0])]
    news = dict(zip(names, states, strict=True))
    kept.keep(program, kind, x, news, (xn, alive, y_mix, tail_args[1]))
    # (x and y too: the caller may drop its reference to x, a module call's output, before the program runs; and
    # the step's arguments, whose states a state codec decodes into tensors only these hold)
    return program, (x, y, xn, alive, y_mix, tail_args[1], args), (cache_layer, news)


def _bind_mlp(d: int, p: PreNormParts):
    """bind_tail's binding of the layer's MLP branch (None: the kernels do not compute it as the module does)."""
    if p.mlp is None:
        return bind_tail(d, None, None, None, "")
    mlp = p.mlp
    if (
        not isinstance(mlp, GatedMLP)
        or not mlp.computes_gated_mlp
        or mlp.act_name not in ACT_MUL
        or not kernel_plain(p.mlp_norm)
        or p.mlp_norm is None
    ):
        return None
    down = mlp._modules["down_proj"]
    parts = mlp.gate_up.parts() if type(down) is DecodeLinear else None
    if parts is None:
        return None
    down_parts = (down.weight, down.bias, down._buffers.get("scale"))
    return bind_tail(d, kernel_args(p.mlp_norm), parts, down_parts, mlp.act_name)

"""The fast path of the recurrent mixers (`mixer.accel`, installed by accel.install): an eager float32 decode step of
LFM2's short convolution (nn/recurrent/short_conv.py), a Mamba2 mixer (nn/recurrent/mamba2.py), a
Mamba1 mixer (nn/recurrent/mamba.py; Zamba's over channel groups too), Qwen3-Next's Gated DeltaNet
(nn/recurrent/gated_deltanet.py; the variants with separate projections: delta_mixers.py) or RecurrentGemma's
recurrent block (nn/recurrent/rglru.py) in one C call, projections included (native/steps/recurrent.py). Each
describes its call (`prepare`: a kind in STEPS and its arguments), which a many-layer step runs as a record.

The cache is seen through slots.py's `StateSlots`: the layer's current `states` are read, the kernel writes the new
ones into fresh tensors, and `update` hands them to the cache, which commits them with its block (trails, codecs and
rollback stay the cache's). Anything else (a prefill, padding in the block, float64 upcast, states or weights the
kernel does not read, module hooks inside the mixer) runs the reference `forward`: the call returns None.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.kernel_memo import KernelMemo
from hybridcache.accel.native.steps.recurrent import (
    bind_mamba2_step,
    gated_delta_args,
    gated_delta_step,
    mamba_args,
    mamba_groups_args,
    mamba_groups_step,
    mamba_step,
    rglru_args,
    rglru_step,
    short_conv_args,
    short_conv_step,
)
from hybridcache.accel.slots import holds_states
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.linear import DecodeLinear
from hybridcache.nn.core.mlp import ACTIVATIONS
from hybridcache.nn.core.norms import kernel_args, kernel_plain
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer, GatedHeadNorm
from hybridcache.nn.recurrent.mamba import MambaMixer
from hybridcache.nn.recurrent.mamba2 import GatedRMSNorm, Mamba2Mixer
from hybridcache.nn.recurrent.rglru import RecurrentBlock
from hybridcache.nn.recurrent.short_conv import ShortConv

_F32 = torch.float32
_LINEARS = (nn.Linear, DecodeLinear)


def _projection(lin: nn.Module) -> tuple | None:
    """A plain projection's (weight, bias, per-row scale) as the kernels take them; None: another kind of module, or
    one with hooks (its call would run them)."""
    if type(lin) not in _LINEARS or lin._forward_hooks or lin._forward_pre_hooks:
        return None
    return lin.weight, lin.bias, lin._buffers.get("scale")


def _decode_step(h: torch.Tensor, layer, step: StepInput) -> bool:
    """Whether this is an eager one-token step with no padding on a state layer the fast path may update."""
    return (
        h.dim() == 3
        and h.shape[1] == 1
        and h.dtype is _F32
        and getattr(step, "all_real", False)
        and holds_states(layer)
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


# a mixer's step kind -> (its one-call step, its checked C arguments' builder: native/steps/recurrent.py)
STEPS = {
    "short_conv": (short_conv_step, short_conv_args),
    "mamba2": (lambda bound, *a: bound.run(*a), lambda bound, *a: bound.args(*a)),  # (a Mamba2Step, x, states)
    "mamba": (mamba_step, mamba_args),
    "gated_delta": (gated_delta_step, gated_delta_args),
    "delta": (lambda bound, *a: bound.run(*a), lambda bound, *a: bound.args(*a)),  # (a DeltaStep, x, states)
    "rglru": (rglru_step, rglru_args),
    "mamba_groups": (mamba_groups_step, mamba_groups_args),
}


class RecurrentAccel:
    """A recurrent mixer's fast path: accel(h, layer, step) -> y [B, 1, D] by its one-call step, the new states handed
    to `layer`; None (the reference runs). `prepare` says what the call is: (its kind in STEPS, the step's
    arguments, the names of the states it returns) or None; a decode step that runs many layers in one C call
    (pre_norm_layer.py) builds the same call's arguments from it."""

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        raise NotImplementedError

    def __call__(self, h: torch.Tensor, layer, step: StepInput) -> torch.Tensor | None:
        got = self.prepare(h, layer, step)
        if got is None:
            return None
        kind, args, names = got
        out = STEPS[kind][0](*args)
        if out is None:
            return None
        y, *states = out
        layer.update(**dict(zip(names, states, strict=True)))
        return y


class ShortConvAccel(RecurrentAccel):
    """`ShortConv.accel`: accel(h, layer, step) -> y [B, 1, D], or None (the reference runs)."""

    def __init__(self, mixer: ShortConv) -> None:
        self.mixer = mixer

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step):
            return None
        in_proj, out_proj = _projection(m.in_proj), _projection(m.out_proj)
        if in_proj is None or out_proj is None or m.conv._forward_hooks or m.conv._forward_pre_hooks:
            return None
        args = (h, in_proj, m.conv.weight.squeeze(1), m.conv.bias, layer.states["conv"], out_proj)
        return "short_conv", args, ("conv",)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What a bound kernel call depends on of a tensor it points at (its values are read through the pointer)."""
    return None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)


class Mamba2Accel(RecurrentAccel):
    """`Mamba2Mixer.accel`: accel(h, layer, step) -> y [B, 1, D], or None (the reference runs). The kernel's weight
    arguments are checked once (bind_mamba2_step) and again whenever a weight tensor's memory, dtype, shape or
    strides change."""

    def __init__(self, mixer: Mamba2Mixer) -> None:
        self.mixer = mixer
        self._memo = KernelMemo()  # the bound step (a copied or pickled model binds its own weights)

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step) or m._compute_dtype(h) is not _F32:
            return None
        in_proj, out_proj = _projection(m.in_proj), _projection(m.out_proj)
        norm = m.norm
        if in_proj is None or out_proj is None or m.conv1d._forward_hooks or m.conv1d._forward_pre_hooks:
            return None
        if norm is None:
            gate, norm_args = "silu", None
        elif type(norm) is GatedRMSNorm and not (norm._forward_hooks or norm._forward_pre_hooks):
            gate = "norm_before_gate" if norm.norm_before_gate else "norm_after_gate"
            norm_args = (norm.weight, norm.eps)
        else:
            return None
        sizes, limit = (m.num_heads, m.head_dim, m.n_groups, m.state_size), m.time_step_limit
        tensors = (*in_proj, *out_proj, m.conv1d.weight, m.conv1d.bias, m.dt_bias, m.A_log, m.D)
        key = (h.shape[-1], sizes, gate, tuple(limit), norm_args and (_layout(norm.weight), norm.eps))
        key += tuple(_layout(t) for t in tensors)
        bound = self._memo.get(
            key,
            lambda: bind_mamba2_step(
                h.shape[-1], sizes, in_proj, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.dt_bias, m.A_log, m.D,
                limit, gate, norm_args, out_proj,
            ),
        )  # fmt: skip
        if bound is None:
            return None
        states = layer.states
        return "mamba2", (bound, h, states["conv"], states["ssm"]), ("conv", "ssm")


class MambaAccel(RecurrentAccel):
    """`MambaMixer.accel` (Mamba, Jamba): accel(h, layer, step) -> y [B, 1, D], or None (the reference runs)."""

    def __init__(self, mixer: MambaMixer) -> None:
        self.mixer = mixer

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step):
            return None
        projs = [_projection(p) for p in (m.in_proj, m.x_proj, m.dt_proj, m.out_proj)]
        if None in projs or m.conv1d._forward_hooks or m.conv1d._forward_pre_hooks:
            return None
        norms = None
        if m.inner_norms:
            mods = (m.dt_layernorm, m.b_layernorm, m.c_layernorm)
            if not all(kernel_plain(n) and not (n._forward_hooks or n._forward_pre_hooks) for n in mods):
                return None
            norms = tuple(kernel_args(n) for n in mods)
        states = layer.states
        args = (
            h, projs[0], m.conv1d.weight.squeeze(1), m.conv1d.bias, states["conv"], projs[1], norms, projs[2],
            m.A_log, m.D, states["ssm"], projs[3],
        )  # fmt: skip
        return "mamba", args, ("conv", "ssm")


class GatedDeltaAccel(RecurrentAccel):
    """`GatedDeltaNetMixer.accel` (Qwen3-Next): accel(h, layer, step) -> y [B, 1, D], or None (the reference runs)."""

    def __init__(self, mixer: GatedDeltaNetMixer) -> None:
        self.mixer = mixer

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step):
            return None
        projs = [_projection(p) for p in (m.in_proj_qkvz, m.in_proj_ba, m.out_proj)]
        norm = m.norm
        if None in projs or type(norm) is not GatedHeadNorm or norm._forward_hooks or norm._forward_pre_hooks:
            return None
        if m.conv1d._forward_hooks or m.conv1d._forward_pre_hooks or m.conv1d.bias is not None:
            return None
        states = layer.states
        args = (
            h, (m.hk, m.hv, m.dk, m.dv), projs[0], projs[1], m.conv1d.weight.squeeze(1), states["conv"], m.dt_bias,
            m.A_log, m.beta_scale, states["recurrent"], (norm.weight, norm.eps), projs[2],
        )  # fmt: skip
        return "gated_delta", args, ("conv", "recurrent")


def gated_delta_accel(mixer: GatedDeltaNetMixer) -> GatedDeltaAccel | None:
    return GatedDeltaAccel(mixer) if type(mixer) is GatedDeltaNetMixer else None


def mamba_accel(mixer: MambaMixer) -> MambaAccel | None:
    return MambaAccel(mixer) if type(mixer) is MambaMixer else None


def short_conv_accel(mixer: ShortConv) -> ShortConvAccel | None:
    return ShortConvAccel(mixer) if type(mixer) is ShortConv else None


def mamba2_accel(mixer: Mamba2Mixer) -> Mamba2Accel | None:
    return Mamba2Accel(mixer) if type(mixer) is Mamba2Mixer else None


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


_GELU_TANH = (ACTIVATIONS["gelu_pytorch_tanh"], ACTIVATIONS["gelu_new"])  # the branch activation the kernel computes


class RGLRUAccel(RecurrentAccel):
    """`RecurrentBlock.accel` (RecurrentGemma): accel(h, layer, step) -> y [B, 1, D], or None (the reference runs)."""

    def __init__(self, block: RecurrentBlock) -> None:
        self.block = block

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.block
        positions = getattr(step, "positions", None)  # (where the LRU restarts; a decode run's step has none)
        if positions is None or not _decode_step(h, layer, step) or m.act not in _GELU_TANH:
            return None
        if _hooked(m.conv_1d, m.rg_lru):
            return None
        projs = [_projection(p) for p in (m.linear_y, m.linear_x, m.linear_out)]
        if None in projs:
            return None
        lru, states = m.rg_lru, layer.states
        gates = (lru.input_gate_weight, lru.input_gate_bias, lru.recurrent_gate_weight, lru.recurrent_gate_bias)
        args = (
            h, lru.num_heads, projs[0], projs[1], m.conv_1d.weight[:, 0], m.conv_1d.bias, states["conv"], gates,
            lru.recurrent_param, positions, states["lru"], projs[2],
        )  # fmt: skip
        return "rglru", args, ("conv", "lru")


class MambaGroupsAccel(RecurrentAccel):
    """The accel of a Mamba1 mixer over channel groups (Zamba's: per-group x_proj_weight [G, R + 2N, Di/G],
    dt_proj_weight [G, Di/G, R], dt_proj_bias, in_proj's u and gate interleaved; registered by its model file):
    accel(h, layer, step) -> y [B, 1, D], or None (the reference runs)."""

    def __init__(self, mixer: MambaMixer) -> None:
        self.mixer = mixer

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step) or m.inner_norms or _hooked(m.conv1d):
            return None
        in_proj, out_proj = _projection(m.in_proj), _projection(m.out_proj)
        if in_proj is None or out_proj is None:
            return None
        states = layer.states
        args = (
            h, in_proj, m.conv1d.weight[:, 0], m.conv1d.bias, states["conv"], m.x_proj_weight, m.dt_proj_weight,
            m.dt_proj_bias.reshape(-1), m.A_log.reshape(m.intermediate, m.state_size), m.D.reshape(-1),
            states["ssm"], out_proj,
        )  # fmt: skip
        return "mamba_groups", args, ("conv", "ssm")


def rglru_accel(block: RecurrentBlock) -> RGLRUAccel | None:
    return RGLRUAccel(block) if type(block) is RecurrentBlock else None


def mamba_groups_accel(cls: type[MambaMixer]):
    """The registry's maker for Mamba1 mixers of exactly `cls` over channel groups (Zamba's)."""
    return lambda mixer: MambaGroupsAccel(mixer) if type(mixer) is cls else None

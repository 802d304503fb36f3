"""The fast path of the delta-rule mixers whose projections are separate matrices (Qwen3.5's and OLMo-Hybrid's Gated
DeltaNet, Kimi's and Bailing's KDA): an eager float32 decode step in one C call, projections, convs, gates, the
delta rule, the gated head norm and the output projection included (native/steps/recurrent.py `delta_step`).

A mixer class describes its step as a `DeltaForm` (which of its modules feed the conv, the output gate, beta and
the decay, and the decay's kind) and is registered with `delta_accel(cls, form)`; the model files of Qwen3.5,
OLMo-Hybrid and GLM-5-Next register theirs, install.py the KDA ones. Only that exact class gets it (a subclass may
compute another step). The cache is seen as in recurrent_mixers.py: anything the kernel does not take runs the
reference `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridcache.accel.kernel_memo import KernelMemo
from hybridcache.accel.mixers.recurrent import RecurrentAccel, _decode_step, _layout, _projection
from hybridcache.accel.native.steps.recurrent import bind_delta_step
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer, GatedHeadNorm
from hybridcache.nn.recurrent.kda import BailingDeltaAttention, KimiDeltaAttention, SigmoidGatedHeadNorm

_NORM_GATES = {GatedHeadNorm: "silu", SigmoidGatedHeadNorm: "sigmoid"}  # the head norm's class -> its gate


@dataclass(frozen=True)
class DeltaForm:
    """A delta mixer's decode step by its modules' names. `qkv`: the projections whose outputs, in order, are the
    conv input [q | k | v]; `convs`: one conv module over all those channels, or one per projection; `z` / `a`: the
    output gate's and the decay logits' projection (two names: a low-rank pair, the first applied to the input);
    `b`: beta's; `decay`: "head" (one per value head), "channel" (one per key channel) or "bounded" (per key channel,
    lower_bound * sigmoid: the mixer's `lower_bound`); `beta_scaled`: whether the mixer's beta_scale applies."""

    qkv: tuple[str, ...]
    convs: tuple[str, ...]
    z: tuple[str, ...]
    b: str
    a: tuple[str, ...]
    decay: str = "head"
    norm: str = "norm"
    out: str = "out_proj"
    beta_scaled: bool = True


KDA = DeltaForm(
    qkv=("q_proj", "k_proj", "v_proj"),
    convs=("q_conv1d", "k_conv1d", "v_conv1d"),
    z=("g_a_proj", "g_b_proj"),
    b="b_proj",
    a=("f_a_proj", "f_b_proj"),
    decay="channel",
    norm="o_norm",
    out="o_proj",
    beta_scaled=False,
)
KDA_BOUNDED = DeltaForm(**{**KDA.__dict__, "decay": "bounded"})  # GLM-5-Next's: Kimi's gates, Bailing's decay
BAILING = DeltaForm(**{**KDA.__dict__, "z": ("g_proj",), "a": ("f_proj",)})
BAILING_BOUNDED = DeltaForm(**{**BAILING.__dict__, "decay": "bounded"})


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


class DeltaAccel(RecurrentAccel):
    """`mixer.accel`: accel(h, layer, step) -> y [B, 1, D], or None (the reference runs). The kernel's weight
    arguments are checked once (native/steps/recurrent.py `bind_delta_step`) and again whenever a weight tensor's
    memory, dtype, shape or strides change (a module replaced, a quantization)."""

    def __init__(self, mixer: GatedDeltaNetMixer, form: DeltaForm | Callable[[nn.Module], DeltaForm]) -> None:
        self.mixer, self.form = mixer, form
        self._memo = KernelMemo()  # the bound step (a copied or pickled model binds its own weights)

    def _projections(self, form: DeltaForm) -> tuple[list, tuple[int, int, int]] | None:
        """delta_step's projs (weight, bias, scale, src) and fields (z, b, a); None: a module it does not take."""
        m, projs, index = self.mixer, [], {}
        for name in (*form.qkv, *form.z, form.b, *form.a):
            parts = _projection(getattr(m, name))
            if parts is None:
                return None
            pair = name in form.z[1:] or name in form.a[1:]  # the second of a low-rank pair reads the first
            projs.append((*parts, index[form.z[0] if name in form.z else form.a[0]] if pair else None))
            index[name] = len(projs) - 1
        return projs, (index[form.z[-1]], index[form.b], index[form.a[-1]])

    def _bind(self, form: DeltaForm, projs: list, fields: tuple, convs: list, gate: str, norm, out: tuple):
        m = self.mixer
        conv_ws = [c.weight[:, 0] for c in convs]  # [C, K] each
        if len(conv_ws) == 1 and len(form.qkv) > 1:  # one conv over [q | k | v]: its rows per projection
            conv_ws = list(conv_ws[0].split([p[0].shape[0] for p in projs[: len(form.qkv)]]))
        lower = float(m.lower_bound) if form.decay == "bounded" else 0.0
        return bind_delta_step(
            (m.hk, m.hv, m.dk, m.dv), projs, len(form.qkv), fields, conv_ws,
            (form.decay, m.dt_bias, m.A_log.reshape(-1), lower), m.beta_scale if form.beta_scaled else 1.0,
            (gate, norm.weight, norm.eps), out,
        )  # fmt: skip

    def prepare(self, h: torch.Tensor, layer, step: StepInput) -> tuple[str, tuple, tuple[str, ...]] | None:
        m = self.mixer
        if not _decode_step(h, layer, step):
            return None
        form = self.form if isinstance(self.form, DeltaForm) else self.form(m)
        norm, out = getattr(m, form.norm), _projection(getattr(m, form.out))
        convs = [getattr(m, name) for name in form.convs]
        gate = _NORM_GATES.get(type(norm))
        if gate is None or out is None or _hooked(norm) or any(_hooked(c) or c.bias is not None for c in convs):
            return None
        got = self._projections(form)
        if got is None:
            return None
        projs, fields = got
        tensors = [t for p in projs for t in p[:3]] + [c.weight for c in convs]
        tensors += [m.dt_bias, m.A_log, norm.weight, out[0], out[1], out[2]]
        key = (form, gate, fields, norm.eps, m.beta_scale, getattr(m, "lower_bound", None), m.hk, m.hv, m.dk, m.dv)
        key += tuple(_layout(t) for t in tensors)
        bound = self._memo.get(key, lambda: self._bind(form, projs, fields, convs, gate, norm, out))
        if bound is None:
            return None
        states = layer.states
        return "delta", (bound, h, states["conv"], states["recurrent"]), ("conv", "recurrent")


def delta_accel(cls: type[nn.Module], form: DeltaForm | Callable[[nn.Module], DeltaForm]):
    """The registry's maker for mixers of exactly `cls` (install.register_accel(cls, delta_accel(cls, form)))."""
    return lambda mixer: DeltaAccel(mixer, form) if type(mixer) is cls else None


kda_accel = delta_accel(KimiDeltaAttention, KDA)


def bailing_form(mixer: nn.Module) -> DeltaForm:
    """Bailing's decay: bounded where the mixer has a safe gate. (A named function: a DeltaAccel holds it, and a
    model holding its accels pickles.)"""
    return BAILING_BOUNDED if mixer.safe_gate else BAILING


bailing_accel = delta_accel(BailingDeltaAttention, bailing_form)

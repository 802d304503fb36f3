"""The one install point of the CPU fast path: `install(model)` gives each module the registry knows its `accel`
(a mixer class, or a layer shape, -> the object that runs it by the kernels) and the model its `fast_path`.

The modules keep their reference computation; each offers its `accel` the call first and runs the reference where
it declines (returns None). Nothing here changes a weight: `uninstall(model)` gives the reference path back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.layers.sandwich import SandwichAccel
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.mixers.delta import bailing_accel, kda_accel
from hybridcache.accel.mixers.moe import SparseMoEAccel, gemma4_experts_accel, llama4_moe_accel
from hybridcache.accel.mixers.recurrent import (
    gated_delta_accel,
    mamba2_accel,
    mamba_accel,
    rglru_accel,
    short_conv_accel,
)
from hybridcache.accel.runs import layer_records
from hybridcache.accel.runs.decode_run import RUN_TOKENS, DecodeRun
from hybridcache.accel.runs.embed_head import greedy_forms
from hybridcache.accel.slots import ReservingCache
from hybridcache.nn.attention.mixer import AttentionMixer
from hybridcache.nn.core.pre_norm import PreNormLayer
from hybridcache.nn.core.sandwich import SandwichLayer
from hybridcache.nn.moe.gemma4 import Gemma4Experts
from hybridcache.nn.moe.llama4 import Llama4MoE
from hybridcache.nn.moe.topk import SparseMoE
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer
from hybridcache.nn.recurrent.kda import BailingDeltaAttention, KimiDeltaAttention
from hybridcache.nn.recurrent.mamba import MambaMixer
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer
from hybridcache.nn.recurrent.rglru import RecurrentBlock
from hybridcache.nn.recurrent.short_conv import ShortConv

# module class -> its fast path's maker; a subclass gets its nearest base's (its own entry first)
ACCELS: dict[type[nn.Module], Callable[[nn.Module], object]] = {
    AttentionMixer: AttentionAccel,
    SandwichLayer: SandwichAccel,
    PreNormLayer: PreNormAccel,  # (records only: a many-layer decode step reads it, the layer's forward does not)
    Mamba2Mixer: mamba2_accel,  # None for a subclass (its forward may differ)
    ShortConv: short_conv_accel,
    MambaMixer: mamba_accel,  # None for a subclass (Zamba's)
    GatedDeltaNetMixer: gated_delta_accel,  # None for a subclass (Qwen3.5's, OLMo's: their model files register)
    KimiDeltaAttention: kda_accel,
    BailingDeltaAttention: bailing_accel,
    RecurrentBlock: rglru_accel,
    SparseMoE: SparseMoEAccel,  # (its subclasses too: the accel calls the module's own route and experts)
    Llama4MoE: llama4_moe_accel,
    Gemma4Experts: gemma4_experts_accel,  # (Granite's and Nemotron-H's MoE blocks: their model files register)
}


class AccelError(ValueError):
    """What the fast path cannot install: a registry entry that is not (an nn.Module subclass, a callable), a model
    that is not an nn.Module."""


def register_accel(cls: type[nn.Module], make: Callable[[nn.Module], object]) -> None:
    """Give modules of `cls` (and its subclasses without their own entry) the fast path `make(module)`: an object
    the module's forward offers each call first (None from it: the reference runs). Takes effect at `install`."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or not callable(make):
        raise AccelError(f"register_accel takes an nn.Module subclass and a callable, got {cls!r}, {make!r}")
    ACCELS[cls] = make


def accel_for(module: nn.Module) -> object | None:
    """The fast path the registry makes for `module` (None: none)."""
    for cls in type(module).__mro__:
        make = ACCELS.get(cls)
        if make is not None:
            return make(module)
    return None


class FastPath:
    """`model.fast_path`: what the model body and generation ask of the accelerator."""

    run_tokens = RUN_TOKENS  # decode steps per run at most (the spare slots a run reserves in every layer)

    def layers(self, blocks, entries, h: torch.Tensor, step) -> torch.Tensor | None:
        """h [B, 1, D] through every layer of an eager decode step with few C calls (layer_records.py); None
        (nothing run) where it does not apply: the caller runs the layers one module call each."""
        return layer_records.record_step(blocks, entries, h, step)

    def start_run(self, model, cache: ReservingCache, capacity: int, ids: torch.Tensor, h: torch.Tensor):
        """A DecodeRun of up to `capacity` steps (decode_run.py), or None (nothing changed): decode step by step."""
        return DecodeRun.start(model, cache, capacity, ids, h)

    def greedy_loop(self, model) -> bool:
        """Whether the model's embedding and head are forms the greedy C loop computes (DecodeRun.greedy)."""
        return greedy_forms(model) is not None


def install(model: nn.Module) -> FastPath:
    """Attach the fast path to `model`: every module the registry knows gets its `accel`, the model `fast_path`."""
    if not isinstance(model, nn.Module):
        raise AccelError(f"install takes an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        fast = accel_for(module)
        if fast is not None:
            module.accel = fast
    model.fast_path = FastPath()
    return model.fast_path


def uninstall(model: nn.Module) -> None:
    """The reference path only: every module's `accel` and the model's `fast_path` back to None."""
    if not isinstance(model, nn.Module):
        raise AccelError(f"uninstall takes an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if "accel" in module.__dict__:
            module.accel = None
    model.fast_path = None

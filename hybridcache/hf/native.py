"""An HF model's layout as our native cache layers: which of our types serves each HF cache, with which shapes.

Attention: HF's pattern (full / sliding(W) / chunked(C), the same conventions as ours: W and C count the current
token) with the stored heads and width. Keys and values of different widths (multi-head latent attention) are held
at the larger width, the narrower one zero-padded by the bridge and sliced back (exact for dense storage).

Linear-attention states map onto our recurrent types by their shapes: conv [C, K] alone is `conv`; with a recurrent
state [D, N] and C == D, `mamba` (Zamba's [H, D/H, N] too, reshaped); [H, P, N] with C = H*P + 2*G*N, `mamba2`;
[Hv, Dk, Dv] with C = 2*Hk*Dk + Hv*Dv, `gated_delta` (families known to be gated delta-rule layers are tried as that
first). Our conv state keeps the last K-1 inputs (what a width-K causal conv needs); HF keeps K and never reads the
oldest one (its decode step concatenates the new input and keeps the last K outputs' window), so the bridge drops it
on the way in and puts back a zero column on the way out (checked against HF's own cache on every covered family).

DeepSeek sparse attention (HF's DynamicIndexedLayer) caches indexer keys [S, D] beside its keys and values: a group
{"attention": full, "indexer": full with one head}, as hybridcache's GLM5-Next holds them.

DeepSeek-V4's compressed attention (HF's DeepseekV4HCACache / CSACache) is a group {"attention": sliding, plus one
`compressed_kv` per compressor: "compressor", and for CSA "indexer"} (hf/compressed.py).

A decoder layer with both (HF's "hybrid" layers: FalconH1, Zamba2's shared attention) is a `NativeGroup`
{"attention": ..., <state type>: ...}. Layers that cache nothing get no entry; `entry_of` maps HF layer indices to
our cache entries and `translate_config` rewrites a config's `layers:` keys accordingly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridcache.cache import NativeGroup, NativeLayer
from hybridcache.hf.compressed import compressor_members
from hybridcache.hf.errors import BridgeConfigError, BridgeError
from hybridcache.hf.layout import LayerInfo, ModelLayout, StateShape

GATED_DELTA_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid")


@dataclass(frozen=True)
class PartSpec:
    """One HF state of a multi-state layer (multi_state_layer.py): `conv` or `recurrent` and its `state_idx`, our
    group member holding it, HF's width (a conv state's columns; 0 for a 1-d state) and dtype."""

    kind: str
    state_idx: int
    member: str
    width: int
    dtype: torch.dtype


@dataclass(frozen=True)
class BridgePlan:
    """Our native layers for the cached HF layers, and where each HF layer's cache lives among them."""

    native: tuple[NativeLayer | NativeGroup, ...]
    entry_of: Mapping[int, int]  # HF layer index -> our cache entry index (cached layers only)
    state_type: Mapping[int, str]  # HF layer index -> our recurrent type (layers with states)
    parts: Mapping[int, tuple[PartSpec, ...]] = field(default_factory=dict)  # layers with several states


def attention_native(info: LayerInfo) -> NativeLayer:
    a = info.attention
    params: dict[str, Any] = dict(num_kv_heads=a.num_kv_heads, head_dim=max(a.key_dim, a.value_dim), dtype=a.dtype)
    if a.pattern == "sliding":
        return NativeLayer("sliding", {**params, "window": a.size})
    if a.pattern == "chunked":
        return NativeLayer("chunked", {**params, "chunk_size": a.size})
    return NativeLayer("full", params)


def _mamba2_groups(c: int, h: int, p: int, n: int) -> int | None:
    rest = c - h * p
    if rest <= 0 or rest % (2 * n):
        return None
    g = rest // (2 * n)
    return g if h % g == 0 else None


def _delta_k_heads(c: int, hv: int, dk: int, dv: int) -> int | None:
    rest = c - hv * dv
    if rest <= 0 or rest % (2 * dk):
        return None
    hk = rest // (2 * dk)
    return hk if hv % hk == 0 else None


def state_native(model_type: str, index: int, s: StateShape) -> NativeLayer:
    """Our recurrent type and shapes for one HF layer's states (a `BridgeError` naming the shapes if none fits)."""
    where = f"{model_type}: layer {index}"
    if not s.conv and list(s.recurrent) == [0] and len(s.recurrent[0][0]) == 3:  # MiniMax's lightning attention
        (h, dk, dv), dtype = s.recurrent[0]
        return NativeLayer(
            "linear_attention", dict(num_heads=h, key_dim=dk, value_dim=dv, dtype=dtype, state_dtype=dtype)
        )
    if len(s.conv) != 1 or len(s.recurrent) > 1 or 0 not in s.conv:
        raise BridgeError(
            f"{where} keeps {len(s.conv)} conv and {len(s.recurrent)} recurrent states; the bridge maps one conv "
            "state (and at most one recurrent state) per layer"
        )
    (c, k), conv_dtype = s.conv[0]
    common = dict(conv_kernel=k, dtype=conv_dtype)
    if not s.recurrent:
        return NativeLayer("conv", dict(channels=c, **common))
    shape, state_dtype = s.recurrent[0]
    common["state_dtype"] = state_dtype
    if len(shape) == 2 and shape[0] == c:
        return NativeLayer("mamba", dict(intermediate_size=c, state_size=shape[1], **common))
    if len(shape) == 3 and shape[0] * shape[1] == c:  # Zamba's multi-head Mamba1: [H, D/H, N] is [D, N] by heads
        return NativeLayer("mamba", dict(intermediate_size=c, state_size=shape[2], **common))
    if len(shape) == 3:
        h, p, n = shape
        as_mamba2 = _mamba2_groups(c, h, p, n)
        as_delta = _delta_k_heads(c, h, p, n)
        mamba2 = NativeLayer("mamba2", dict(num_heads=h, head_dim=p, state_size=n, n_groups=as_mamba2 or 1, **common))
        delta = NativeLayer(
            "gated_delta", dict(num_k_heads=as_delta or 1, num_v_heads=h, head_k_dim=p, head_v_dim=n, **common)
        )
        if as_delta and (model_type in GATED_DELTA_FAMILIES or not as_mamba2):
            return delta
        if as_mamba2:
            return mamba2
    raise BridgeError(
        f"{where}: no hybridcache recurrent type holds a conv state [{c}, {k}] with a recurrent state "
        f"{list(shape)} (mamba: [C, N]; mamba2: [H, P, N] with C = H*P + 2*G*N; gated_delta: [Hv, Dk, Dv] with "
        "C = 2*Hk*Dk + Hv*Dv)"
    )


def multi_state_members(model_type: str, info: LayerInfo) -> tuple[dict[str, NativeLayer], tuple[PartSpec, ...]]:
    """Our `conv` members for a layer with attention and several states, or a 1-d recurrent state (Inkling's four
    short convolutions; ZAYA's conv state and delayed value [C]): one member per state. A 1-d state [C] is the
    previous token's input, a width-2 conv state. Raises a `BridgeError` naming the shapes for anything else."""
    s = info.states
    members: dict[str, NativeLayer] = {}
    parts: list[PartSpec] = []
    for i, ((c, k), dtype) in sorted(s.conv.items()):
        members[f"conv{i}"] = NativeLayer("conv", dict(channels=c, conv_kernel=k, dtype=dtype))
        parts.append(PartSpec("conv", i, f"conv{i}", k, dtype))
    for i, (shape, dtype) in sorted(s.recurrent.items()):
        if len(shape) != 1 or info.attention is None:
            raise BridgeError(
                f"{model_type}: layer {info.index} keeps {len(s.conv)} conv and {len(s.recurrent)} recurrent states "
                f"(recurrent state {i}: {list(shape)}); the bridge maps several states per layer only as conv "
                "states and 1-d states beside an attention cache"
            )
        members[f"state{i}"] = NativeLayer("conv", dict(channels=shape[0], conv_kernel=2, dtype=dtype))
        parts.append(PartSpec("recurrent", i, f"state{i}", 0, dtype))
    return members, tuple(parts)


def _several_states(info: LayerInfo) -> bool:
    s = info.states
    return info.attention is not None and (len(s.conv) > 1 or any(len(sh) == 1 for sh, _ in s.recurrent.values()))


def bridge_plan(layout: ModelLayout) -> BridgePlan:
    native: list[NativeLayer | NativeGroup] = []
    entry_of: dict[int, int] = {}
    state_type: dict[int, str] = {}
    parts: dict[int, tuple[PartSpec, ...]] = {}
    for info in layout.layers:
        if not info.cached:
            continue
        attn = attention_native(info) if info.attention is not None else None
        if info.states is not None and _several_states(info):
            members, parts[info.index] = multi_state_members(layout.model_type, info)
            entry_of[info.index] = len(native)
            native.append(NativeGroup({"attention": attn, **members}))
            continue
        state = state_native(layout.model_type, info.index, info.states) if info.states is not None else None
        if state is not None:
            state_type[info.index] = state.type
        entry_of[info.index] = len(native)
        if info.compressors:  # DeepSeek-V4: the sliding window and one compressed_kv per compressor
            native.append(NativeGroup({"attention": attn, **compressor_members(info.compressors)}))
        elif info.indexer_dim is not None:  # DSA: the indexer keys are one more full-attention cache of one head
            index = NativeLayer("full", dict(num_kv_heads=1, head_dim=info.indexer_dim, dtype=info.attention.dtype))
            native.append(NativeGroup({"attention": attn, "indexer": index}))
        elif attn is not None and state is not None:
            native.append(NativeGroup({"attention": attn, state.type: state}))
        else:
            native.append(attn or state)
    if not native:
        raise BridgeError(f"{layout.model_type}: no layer of this model keeps a cache")
    return BridgePlan(tuple(native), entry_of, state_type, parts)


def translate_config(config: Mapping[str, Any] | None, plan: BridgePlan, layout: ModelLayout) -> dict[str, Any]:
    """The cache config with its `layers:` keys (HF decoder-layer indices) rewritten to our cache entries."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise BridgeConfigError(f"cache config must be a mapping, got {type(config).__name__}")
    out = dict(config)
    layers = config.get("layers")
    if layers is None:
        return out
    if not isinstance(layers, Mapping):
        raise BridgeConfigError(f"cache config: 'layers' must be a mapping, got {layers!r}")
    n = len(layout.layers)
    moved: dict[Any, Any] = {}
    for key, entry in layers.items():
        index_text, dot, member = str(key).partition(".")
        try:
            i = int(index_text)
        except ValueError:
            raise BridgeConfigError(
                f"cache config: layers.{key}: layer keys are indices like 3 or 3.attention"
            ) from None
        if not 0 <= i < n:
            raise BridgeConfigError(f"cache config: layers.{key}: layer index out of range (the model has {n} layers)")
        if i not in plan.entry_of:
            raise BridgeConfigError(
                f"cache config: layers.{key}: decoder layer {i} ({layout.layers[i].hf_type}) keeps no cache"
            )
        moved[f"{plan.entry_of[i]}{dot}{member}"] = entry
    out["layers"] = moved
    return out

"""What each decoder layer of an HF model caches, read from HF itself: its layer types (`get_layer_types_and_kwargs`,
what HF's `DynamicCache(config=...)` is built from) and one probe forward of a single token through a
`DynamicCache`, which shows each layer's key / value shapes, conv / recurrent state shapes, dtypes and devices exactly
as the model hands them to its cache. Generic over families: nothing here reads family-specific config fields.

The probe runs under `torch.no_grad()` with the caller's RNG state saved and restored, so it changes nothing a later
generation could see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridcache.hf.compressed import compressor_shapes
from hybridcache.hf.errors import BridgeError


@dataclass(frozen=True)
class AttentionShape:
    """One attention cache of an HF layer: heads, key / value widths, dtype and device of what it stores, and its
    HF pattern ("full", "sliding" (window) or "chunked" (chunk size))."""

    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    pattern: str = "full"
    size: int | None = None  # window or chunk size


@dataclass(frozen=True)
class StateShape:
    """The linear-attention states of an HF layer: per state index, the conv state [C, K] and the recurrent state
    shape (None: conv only), without the batch dim."""

    conv: dict[int, tuple[tuple[int, ...], torch.dtype]]
    recurrent: dict[int, tuple[tuple[int, ...], torch.dtype]]
    device: torch.device


@dataclass(frozen=True)
class LayerInfo:
    """One decoder layer as HF caches it: its HF layer type and the attention and / or state shapes (both None: the
    layer caches nothing, e.g. an MLP-only layer or a KV-sharing reader)."""

    index: int
    hf_type: str
    attention: AttentionShape | None = None
    states: StateShape | None = None
    indexer_dim: int | None = None  # DeepSeek sparse attention: the width of the indexer keys [S, D] it caches
    compressors: tuple = ()  # DeepSeek-V4 compressed attention: its compressors (hf/compressed.py, CompressorShape)
    dummy: bool = False  # HF's DummyLayer (no cache by design); else an empty layer is one the probe left unused

    @property
    def cached(self) -> bool:
        return self.attention is not None or self.states is not None


@dataclass(frozen=True)
class ModelLayout:
    """Every decoder layer of a model, its family (config.model_type) and the device its inputs go to."""

    model_type: str
    layers: tuple[LayerInfo, ...]
    input_device: torch.device
    notes: tuple[str, ...] = field(default_factory=tuple)


def decoder_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def decoder_layer(model: Any, index: int) -> torch.nn.Module | None:
    """The module of decoder layer `index` (None if the decoder keeps no `layers` list)."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    layers = getattr(decoder, "layers", None)
    return layers[index] if isinstance(layers, torch.nn.ModuleList) and index < len(layers) else None


def input_device(model: Any) -> torch.device:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device


def read_layout(model: Any) -> ModelLayout:
    """Probe `model` (an HF PreTrainedModel) once and describe its cache layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        CacheLayerMixin,
        DummyLayer,
        DynamicIndexedLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionCacheLayerMixin,
        LinearAttentionLayer,
        get_layer_types_and_kwargs,
    )

    # HF's plain layer classes: keys and values (and DSA's indexer keys), conv and recurrent states; and layers with
    # compressors (DeepSeek-V4, hf/compressed.py). Others (a family's own layer class) store more than the bridge holds.
    KNOWN = (
        DummyLayer,
        DynamicIndexedLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
    )

    config = decoder_config(model)
    model_type = str(getattr(config, "model_type", type(model).__name__))
    try:
        hf_types, kwargs = get_layer_types_and_kwargs(config)
    except Exception as e:  # noqa: BLE001 - HF's own reading of the config failed: say which model
        raise BridgeError(f"{model_type}: HF cannot tell this model's layer types ({type(e).__name__}: {e})") from e
    own = own_cache(model_type)  # a family whose model takes only its own cache class (MiniMax)
    cache = DynamicCache(config=config) if own is None else own
    device = input_device(model)
    ids = torch.full((1, 1), 3, dtype=torch.long, device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
        try:
            model(input_ids=ids, cache=cache, use_cache=True)
        except Exception as e:  # noqa: BLE001 - the model itself cannot run with HF's own cache: say so
            raise BridgeError(
                f"{model_type}: a one-token forward with HF's own DynamicCache failed, so this model cannot be "
                f"bridged ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
    layers = []
    count = len(cache.layers) if own is None else len(hf_types)  # MiniMaxCache adds layers only as they are used
    for i in range(count):
        layer = cache.layers[i] if i < len(cache.layers) else DynamicLayer()
        hf_type = hf_types[i] if i < len(hf_types) else "full_attention"
        attention, states = None, (None if own is None else linear_state(cache, i))
        module = decoder_layer(model, i) if hasattr(layer, "store_compression_weights") else None  # (compressors only)
        compressors = compressor_shapes(layer, f"{model_type}: layer {i}", module)
        if type(layer) not in KNOWN and compressors is None:
            raise BridgeError(
                f"{model_type}: layer {i} uses HF's {type(layer).__name__} ({hf_type}), which stores more than keys, "
                "values and states; it has no hybridcache counterpart yet"
            )
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            k, v = layer.keys, layer.values
            pattern, size = "full", None
            if isinstance(layer, DynamicSlidingWindowLayer):
                size = int(kwargs[i].get("sliding_window") or layer.sliding_window)
                pattern = "chunked" if hf_type == "chunked_attention" else "sliding"
            elif own is not None and getattr(config, "sliding_window", None):
                # MiniMax keeps every key in a DynamicLayer and masks them with a sliding window when one is set
                pattern, size = "sliding", int(config.sliding_window)
            attention = AttentionShape(
                int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1]), k.dtype, k.device, pattern, size
            )
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            conv = {
                s: (tuple(t.shape[1:]), t.dtype)
                for s, t in layer.conv_states.items()
                if t is not None and layer.is_conv_states_initialized.get(s)
            }
            rec = {
                s: (tuple(t.shape[1:]), t.dtype)
                for s, t in layer.recurrent_states.items()
                if t is not None and layer.is_recurrent_states_initialized.get(s)
            }
            if conv or rec:
                some = next(iter(layer.conv_states.values() if conv else layer.recurrent_states.values()))
                states = StateShape(conv, rec, some.device)
        indexer = getattr(layer, "indexer_keys", None)
        indexer_dim = int(indexer.shape[-1]) if isinstance(indexer, torch.Tensor) and indexer.numel() else None
        dummy = isinstance(layer, DummyLayer)
        layers.append(LayerInfo(i, hf_type, attention, states, indexer_dim, compressors or (), dummy=dummy))
    return ModelLayout(model_type, tuple(layers), device)


OWN_CACHE_FAMILIES = ("minimax",)  # model types whose model takes only its own cache class (hf/own_cache.py)


def own_cache(model_type: str) -> Any | None:
    """A fresh MiniMaxCache for the probe of a MiniMax model, whose model refuses any other (None for every other
    family: they are probed with HF's DynamicCache)."""
    if model_type not in OWN_CACHE_FAMILIES:
        return None
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache()


def linear_state(cache: Any, index: int) -> StateShape | None:
    """The lightning state the probe left in layer `index` of a MiniMaxCache (its `linear_cache` list): one
    recurrent state [H, D, D] and no conv state."""
    states = getattr(cache, "linear_cache", None)
    if states is None or index >= len(states) or not isinstance(states[index], torch.Tensor):
        return None
    t = states[index]
    return StateShape({}, {0: (tuple(t.shape[1:]), t.dtype)}, t.device)


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []

"""`cache_for(model, cache_config=None, *, batch_size=None)`: a `transformers.Cache` for an HF model whose layers are
our cache layers, configured with our cache configs.

Steps: read the model's layout once (layout.py: HF's layer types and one probe forward), map it onto our native
cache types (native.py), resolve the cache config against them (the same schema and errors as everywhere:
`attention:`, `recurrent:`, native type names, `layers: {i: ...}` with HF's decoder-layer indices), install the
bridge on the model (installer.py: its attention implementation and forward hooks; idempotent), and return a
`BridgeCache` (built at once for `batch_size` rows, or by its first forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from hybridcache.cache import resolve_plan
from hybridcache.hf.bridge_cache import BridgeCache
from hybridcache.hf.errors import BridgeError
from hybridcache.hf.installer import install
from hybridcache.hf.layout import ModelLayout, read_layout
from hybridcache.hf.native import BridgePlan, bridge_plan, translate_config
from hybridcache.hf.own_cache import bridge_cache_class
from hybridcache.hf.queries import install_query_hooks

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its layout (shapes never change)


def layout_of(model: Any) -> ModelLayout:
    """The model's cache layout (probed once per model object)."""
    layout = _LAYOUTS.get(model)
    if layout is None:
        layout = _LAYOUTS[model] = read_layout(model)
    return layout


def plan_for(model: Any, cache_config: Mapping[str, Any] | None = None):
    """(layout, bridge plan, resolved CachePlan) for `model` under `cache_config`, without touching the model."""
    layout = layout_of(model)
    bridge = bridge_plan(layout)
    return layout, bridge, resolve_plan(bridge.native, translate_config(cache_config, bridge, layout))


def cache_for(
    model: Any, cache_config: Mapping[str, Any] | None = None, *, batch_size: int | None = None
) -> BridgeCache:
    """A `transformers.Cache` for `model` (an HF PreTrainedModel) whose layers are hybridcache cache layers.

    Pass it as `model.generate(ids, cache=c)` or `model(ids, cache=c)` (continued across calls). `cache_config`
    takes our schema; `layers:` keys are the model's decoder-layer indices. `c.hybrid` is the hybridcache `Cache`
    itself (plan, memory report, crop, snapshot), built for `batch_size` rows now or by the first forward.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise BridgeError(f"cache_for needs a transformers PreTrainedModel, got {type(model).__name__}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise BridgeError(f"cache_for: batch_size must be a positive integer or None, got {batch_size!r}")
    layout, bridge, plan = plan_for(model, cache_config)
    ours = install(model)
    cls = bridge_cache_class(layout.model_type, BridgeCache)  # MiniMax: also a MiniMaxCache
    cache = cls(model, layout, bridge, plan, batch_size, hf_masks=not ours)
    if cache.keeps_queries:  # a press that models future queries (expected_attention) reads them from HF's modules
        install_query_hooks(model)
    return cache


__all__ = ["BridgePlan", "cache_for", "layout_of", "plan_for"]

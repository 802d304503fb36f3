"""The bridge's wrappers of HF's attention functions: each implementation a bridged model uses (`sdpa`, `eager`, ...)
is wrapped in place in HF's `AttentionInterface` (installer.py), once per process, keeping its name.

HF builds one mask per layer type before its layers run, from the first layer of each type. A layer that keeps its
native pattern in dynamic storage holds HF's own layout (its slots are the last columns, in order), so HF's mask is
exact there and is used as is: it also carries what our patterns do not know (a multimodal model's bidirectional
image blocks, a sparse-attention selection). Other layers return their own slots (rings, evicted tokens, per-head
positions), which that mask cannot describe. HF's attention call comes right after `cache.update` in every modeling
file that follows the interface, with the very key tensor `update` returned; the wrapper looks that tensor up among
the running block's views (bridge_cache.py) and attends with the view's own mask ([B, T, S], or [B, H, T, S] per
kv head) through HF's own functions: the modeling file's `eager_attention_forward` where the model runs eager
(softcapping, sinks and scalings stay the model's) or where a score-based layer needs the attention weights, HF's
sdpa otherwise. Every other call (another cache, no cache, another thread, a vision tower) goes to HF's function
with HF's mask, unchanged.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from hybridcache.hf.errors import BridgeError

_ACTIVE = threading.local()  # the BridgeCaches whose forward runs in this thread (a stack)
_WRAPPED: set[str] = set()  # interface implementations wrapped so far


def active_stack() -> list:
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


def _original(fn: Callable) -> Callable:
    return getattr(fn, "_hybridcache_base", fn)


def _eager_of(module: torch.nn.Module) -> Callable:
    """The modeling file's own eager attention (its softcapping, sinks, scalings), unwrapped."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise BridgeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
    return _original(fn)


def view_mask(view: Any, query: torch.Tensor) -> torch.Tensor:
    """The view's visibility as a bool mask [B, 1 or Hq, T, S] for HF's attention functions. A query that sees
    nothing (left padding) keeps an all-False row, as in HF's own masks: eager then spreads it uniformly, sdpa gives
    zeros; both as HF does, which matters where padding outputs reach a recurrent state (RecurrentGemma)."""
    mask = view.mask  # [B, T, S] or [B, Hkv, T, S]
    q_len = query.shape[2]
    if mask.shape[-2] != q_len:  # the model dropped queries it does not need (KV-shared layers keep the last ones)
        mask = mask[..., -q_len:, :]
    if mask.dim() == 3:
        mask = mask[:, None]
    elif mask.shape[1] != query.shape[1]:
        mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
    return mask


def make_attention(base: Callable, eager: bool) -> Callable:
    """A wrapper of HF's attention function `base` (`eager`: a modeling file's eager function): the view's mask for
    keys of a running BridgeCache's non-native layers, `base` unchanged for everything else."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        stack = active_stack()
        found = stack[-1].view_for(key) if stack else None
        if found is None or stack[-1].attends_with_hf_mask(found[1]):  # not ours, or a native layout: HF's mask
            return base(module, query, key, value, attention_mask, **kwargs)
        view, layer, first = found
        mask = view_mask(view, query)
        wants_weights = first and getattr(layer, "wants_attention_weights", False)
        queries = None
        if first and getattr(layer, "wants_queries", False):  # expected_attention: the pre-rotary queries
            queries = stack[-1].query_inputs(module, query, kwargs.get("scaling"))
        if eager or wants_weights:
            fn = base if eager else _eager_of(module)
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive.masked_fill_(~mask, torch.finfo(query.dtype).min)
            out, weights = fn(module, query, key, value, additive, **kwargs)
            if wants_weights or queries is not None:
                layer.observe_attention(weights if wants_weights else None, queries)
            return out, (weights if eager else None)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if queries is not None:
            layer.observe_attention(None, queries)
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    attention.__name__ = f"hybridcache_{getattr(base, '__name__', 'attention')}"
    attention._hybridcache_base = base  # (not __wrapped__: HF's own decorators use that name)
    return attention


def wrap(name: str) -> None:
    """Wrap HF's attention implementation `name` in its AttentionInterface (once per process; `eager` is each
    modeling file's own function, wrapped by `wrap_eager`). Implementations HF resolves elsewhere (kernels from the
    hub) are left alone: a bridged layer whose calls the bridge never sees is refused at the block's end."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if name in _WRAPPED or name not in ALL_ATTENTION_FUNCTIONS or name == "eager":
        return
    _WRAPPED.add(name)
    AttentionInterface.register(name, make_attention(ALL_ATTENTION_FUNCTIONS[name], eager=False))


def wrap_eager(modules) -> None:
    """Wrap the eager attention functions of the modeling files that define `modules` (every module-level function
    named `*eager_attention_forward`: what their attention layers pass HF as the eager default, looked up by name at
    each call), once per file."""
    for module in modules:
        source = sys.modules.get(type(module).__module__)
        if source is None:
            continue
        for attr, fn in list(vars(source).items()):
            if attr.endswith("eager_attention_forward") and callable(fn) and not hasattr(fn, "_hybridcache_base"):
                setattr(source, attr, make_attention(fn, eager=True))

"""The attention functions the bridge registers in HF's `AttentionInterface`, one per base implementation.

HF builds one mask per layer type before its layers run, from the first layer of each type; our layers return
their own slots (rings, evicted tokens, per-head positions), so that mask cannot describe them. HF's attention call
comes right after `cache.update` in every modeling file that follows HF's AttentionInterface, with the very key
tensor `update` returned; so `hybridcache_<base>` looks that tensor up among the block's views (bridge_cache.py)
and attends with the view's own mask ([B, T, S], or [B, H, T, S] per kv head), through HF's own functions: the
modeling file's `eager_attention_forward` where the model runs eager (softcapping, sinks and scalings stay the
model's) or where a score-based layer needs the attention weights, HF's sdpa otherwise. Keys that are not from a
bridge view (another cache, no cache, a vision tower) go to the base implementation with HF's own mask, unchanged.

Also registered: the same names in HF's `AttentionMaskInterface`, as the base's mask function, so HF keeps building
its masks for every call that is not ours.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from hybridcache.hf.errors import BridgeError

PREFIX = "hybridcache_"
_ACTIVE = threading.local()  # the BridgeCaches whose forward runs in this thread (a stack)


def active_stack() -> list:
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


def _eager_of(module: torch.nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _base(name: str, module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        fn = _eager_of(module)
        if fn is None:
            raise BridgeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


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


def make_attention(base_name: str) -> Callable:
    """`hybridcache_<base_name>`: the view's mask for bridge keys, `base_name` for everything else."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        stack = active_stack()
        found = stack[-1].view_for(key) if stack else None
        if found is None:
            return _base(base_name, module)(module, query, key, value, attention_mask, **kwargs)
        view, layer, first = found
        mask = view_mask(view, query)
        wants_weights = first and getattr(layer, "wants_attention_weights", False)
        if first and getattr(layer, "wants_queries", False):
            raise BridgeError(
                f"{layer.type_name}: models future queries from the pre-rotary queries, which HF's attention "
                "functions never receive; use it through hybridcache's own models"
            )
        if base_name == "eager" or wants_weights:
            eager = _base("eager", module)
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive.masked_fill_(~mask, torch.finfo(query.dtype).min)
            out, weights = eager(module, query, key, value, additive, **kwargs)
            if wants_weights:
                layer.observe_attention(weights)
            return out, (weights if base_name == "eager" else None)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    attention.__name__ = f"{PREFIX}{base_name}"
    return attention


def register(base_name: str) -> str:
    """Register `hybridcache_<base_name>` in HF's attention and mask interfaces (once); returns the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = f"{PREFIX}{base_name}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, make_attention(base_name))
        if base_name in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    return name

"""What `cache_for` installs on an HF model, once: two forward hooks, and (process-wide, once) the bridge's wrappers
of HF's attention functions.

- The attention functions: HF's `AttentionInterface` entries of every implementation a bridged model uses (`sdpa`,
  flash, ...) and its modeling files' own eager functions are wrapped in place (attention_fn.py). A wrapper is an
  exact pass-through for every call whose keys are not from a running BridgeCache (another cache, no cache, another
  thread, a vision tower), so the model keeps its attention implementation and its name: modeling code that branches
  on `_attn_implementation == "sdpa"` (mask formats) sees what it always saw. Families that predate HF's
  AttentionInterface keep their own attention code and HF's masks; the bridge then serves only cache layouts those
  masks describe (bridge_cache.py, `hf_masks`).
- A pre-hook and an always-called post-hook on the model and on its decoder (whichever a caller enters first owns
  the forward): when the call's cache is a BridgeCache built for this model, the pre-hook opens one block of our
  cache (tokens, real-token mask, token ids) and the post-hook commits it (or drops it when the forward raised).
  Calls with any other cache, or none, pass through untouched.

`uninstall(model)` removes the hooks (the pass-through wrappers stay: they change nothing without a BridgeCache).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.hf.attention_fn import active_stack, wrap, wrap_eager
from hybridcache.hf.errors import BridgeError

_ATTR = "_hybridcache_bridge"


def _find_cache(args: tuple, kwargs: dict) -> Any:
    from hybridcache.hf.bridge_cache import BridgeCache

    for key in ("cache", "past_key_values"):
        if isinstance(kwargs.get(key), BridgeCache):
            return kwargs[key]
    for a in args:
        if isinstance(a, BridgeCache):
            return a
    return None


def _block_inputs(args: tuple, kwargs: dict) -> tuple[int, torch.Tensor | None, torch.Tensor | None, int]:
    """(tokens, real-token mask [B, T] or None, ids [B, T] or None, batch) of a forward's inputs."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        ids = args[0]
    embeds = kwargs.get("inputs_embeds")
    x = ids if ids is not None else embeds
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise BridgeError("the bridge needs input_ids [B, T] or inputs_embeds [B, T, D] to feed its cache")
    batch, tokens = int(x.shape[0]), int(x.shape[1])
    mask = kwargs.get("attention_mask")
    valid = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if mask.shape[-1] < tokens:
            raise BridgeError(
                f"attention_mask has {mask.shape[-1]} columns, fewer than the {tokens} input tokens (HF's convention: "
                "one column per token seen, past and new)"
            )
        valid = mask[:, -tokens:]
    return tokens, valid, (ids if ids is not None and ids.dim() == 2 else None), batch


def _pre_hook(model: torch.nn.Module):
    def hook(module, args, kwargs):
        cache = _find_cache(args, kwargs)
        if cache is None:
            return None
        if not cache.model_is(model):
            raise BridgeError("this BridgeCache was built for another model: call hybridcache.hf.cache_for(model)")
        if cache._depth == 0:
            tokens, valid, ids, batch = _block_inputs(args, kwargs)
            cache.begin(tokens, valid, ids, batch)
            active_stack().append(cache)
        cache._depth += 1
        return None

    return hook


def _post_hook(module, args, kwargs, output):
    cache = _find_cache(args, kwargs)
    if cache is None or cache._depth == 0:
        return None
    cache._depth -= 1
    if cache._depth == 0:
        stack = active_stack()
        if stack and stack[-1] is cache:
            stack.pop()
        cache.end(failed=output is None)
    return None


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - models without a separable decoder
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None


def install(model: torch.nn.Module) -> bool:
    """Install the bridge on `model` (idempotent). Returns whether the model attends through HF's AttentionInterface
    (True: the bridge's wrappers see its attention calls), or computes attention in its own code with HF's masks
    (False: families that predate the interface; bridge_cache.py then serves only layouts HF's masks describe)."""
    installed = getattr(model, _ATTR, None)
    if installed is not None:
        return installed[1]
    for config in _configs(model):
        wrap(config._attn_implementation or "eager")
    wrap_eager(model.modules())
    ours = type(model)._can_set_attn_implementation()  # HF's own test: does its modeling file use the interface?
    handles = []
    for m in (model, _decoder(model)):
        if m is None:
            continue
        handles.append(m.register_forward_pre_hook(_pre_hook(model), with_kwargs=True))
        handles.append(m.register_forward_hook(_post_hook, with_kwargs=True, always_call=True))
    setattr(model, _ATTR, (handles, ours))
    return ours


def _configs(model: torch.nn.Module) -> list:
    """The model's config and its sub-configs (a multimodal model's text and vision towers)."""
    out, todo = [], [model.config]
    while todo:
        config = todo.pop()
        out.append(config)
        todo += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if getattr(config, key, None)]
    return out


def uninstall(model: torch.nn.Module) -> None:
    """Remove the bridge's hooks from `model`."""
    installed = getattr(model, _ATTR, None)
    if installed is None:
        return
    handles, _ = installed
    for h in handles:
        h.remove()
    delattr(model, _ATTR)
    from hybridcache.hf.queries import remove_query_hooks

    remove_query_hooks(model)

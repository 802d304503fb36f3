"""The pre-rotary queries a press that models future queries needs (`expected_attention`), taken from HF's own
attention modules: HF's attention functions receive the queries after rotary only.

`install_query_hooks(model)` puts a forward hook on every attention module's query path: the output of its `q_norm`
where it has one (Gemma 3, Qwen3, Qwen3-Next: the norm comes before rotary), else of its `q_proj`. While a running
BridgeCache asks for queries (its plan holds such a press), the hook keeps that tensor for the module's attention
call, which `query_inputs` turns into the press's `QueryInputs`: the queries [B, Hq, T, D], the mean rotary matrix
of future positions (from the inverse frequencies of HF's rotary embedding for the module's layer type) and the
module's softmax scale.

Nothing here trusts a family's layout: the captured queries, rotated by the chosen rotary table at the block's
positions, must give the very queries HF passed to its attention function (within the dtype's rounding), else the
call is refused by name (a fused projection, a rotary of another layout, queries transformed after the norm).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.methods.scorer import QueryInputs
from hybridcache.hf.attention_fn import active_stack
from hybridcache.hf.errors import BridgeError
from hybridcache.nn.attention.rotary import RotaryEmbedding

_ATTR = "_hybridcache_query_hooks"


def install_query_hooks(model: torch.nn.Module) -> None:
    """Hook the query path of every attention module of `model` (idempotent; `remove_query_hooks` undoes it)."""
    if getattr(model, _ATTR, None) is not None:
        return
    handles = []
    for module in model.modules():
        source = _query_source(module)
        if source is not None:
            handles.append(source.register_forward_hook(_keeper(module)))
    setattr(model, _ATTR, handles)


def remove_query_hooks(model: torch.nn.Module) -> None:
    for h in getattr(model, _ATTR, None) or ():
        h.remove()
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)


def _query_source(module: torch.nn.Module) -> torch.nn.Module | None:
    """The submodule whose output is the module's queries before rotary: q_norm, else q_proj (None: not an
    attention module with a separate query projection)."""
    if not isinstance(getattr(module, "q_proj", None), torch.nn.Module):
        return None
    norm = getattr(module, "q_norm", None)
    return norm if isinstance(norm, torch.nn.Module) else module.q_proj


def _keeper(attention: torch.nn.Module):
    key = id(attention)

    def hook(_module, _args, output):
        stack = active_stack()
        if stack and stack[-1].keeps_queries and isinstance(output, torch.Tensor):
            stack[-1].captured_queries[key] = output.detach()

    return hook


def _candidates(captured: torch.Tensor, query: torch.Tensor) -> list[torch.Tensor]:
    """The layouts [B, Hq, T, D] the captured tensor may hold the queries in (the caller keeps the one that
    rotates into HF's queries)."""
    b, h, t, d = query.shape
    out = []
    if tuple(captured.shape) == (b, h, t, d):
        out.append(captured)
    if tuple(captured.shape) == (b, t, h, d):
        out.append(captured.transpose(1, 2))
    if tuple(captured.shape) == (b, t, h * d):
        out.append(captured.view(b, t, h, d).transpose(1, 2))
    return out


def _rotaries(model: Any, module: torch.nn.Module) -> list[RotaryEmbedding | None]:
    """Rotary tables the module may use, most specific first: its layer type's table of a shared rotary embedding
    (Gemma 3), the module's own, the decoder's; None (no rotary, Jamba) last."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    owners = [getattr(module, "rotary_emb", None), getattr(decoder, "rotary_emb", None)]
    layer_type = getattr(module, "layer_type", None)
    out: list[RotaryEmbedding | None] = []
    for owner in owners:
        if not isinstance(owner, torch.nn.Module):
            continue
        for prefix in ([f"{layer_type}_"] if layer_type else []) + [""]:
            inv_freq = getattr(owner, f"{prefix}inv_freq", None)
            if isinstance(inv_freq, torch.Tensor):
                scaling = float(getattr(owner, f"{prefix}attention_scaling", 1.0) or 1.0)
                out.append(RotaryEmbedding(inv_freq.detach().float().cpu(), scaling))
    return [*out, None]


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if torch.finfo(dtype).bits >= 32 else 5e-2


def query_inputs(cache: Any, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> QueryInputs:
    """The press's `QueryInputs` for HF attention `module`'s call with rotated queries `query` [B, Hq, T, D]."""
    name = type(module).__name__
    captured = cache.captured_queries.pop(id(module), None)
    if captured is None:
        raise BridgeError(
            f"{name}: expected_attention needs the pre-rotary queries, and this attention module has no q_proj / "
            "q_norm the bridge could read them from"
        )
    block = cache.hybrid.current_block
    positions = block.positions.to(query.device)  # [B, T], -1 padding
    if query.shape[2] != positions.shape[1]:
        raise BridgeError(f"{name}: {query.shape[2]} queries for a block of {positions.shape[1]} tokens")
    real = (positions >= 0)[:, None, :, None]  # [B, 1, T, 1]
    target = query.double() * real
    tol = _tolerance(query.dtype) * max(float(target.abs().amax()), 1.0)
    model = cache._model()
    for q_pre in _candidates(captured, query):
        for rotary in _rotaries(model, module):
            if rotary is not None and rotary.rotary_dim > q_pre.shape[-1]:
                continue
            rotated = q_pre if rotary is None else _rotate(rotary, q_pre, block.rope_positions.to(query.device))
            if float((rotated.double() * real - target).abs().amax()) <= tol:
                rotation = None if rotary is None else _mean_rotation(rotary, q_pre.shape[-1])
                scale = float(scaling if scaling is not None else getattr(module, "scaling", q_pre.shape[-1] ** -0.5))
                return QueryInputs(q_pre, rotation, scale)
    raise BridgeError(
        f"{name}: the queries its q_norm / q_proj computed, rotated by its rotary embedding, are not the queries it "
        "attends with (a fused projection or another rotary layout), so expected_attention cannot be served here"
    )


def _rotate(rotary: RotaryEmbedding, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    rotated, _ = rotary(q, q[:, :1], positions)
    return rotated


def _mean_rotation(rotary: RotaryEmbedding, head_dim: int):
    def mean_rotation(positions: torch.Tensor) -> torch.Tensor:
        return rotary.mean_rotation(positions, head_dim=head_dim)

    return mean_rotation

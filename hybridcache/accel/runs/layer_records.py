"""An eager decode step's decoder layers with one C call per run of layers (decoder_stack.py).

A layer whose fast path records (its `accel` offers `binding(x, cache_layer)`, `record(x, y, cache_layer, step,
binding)`, `separate` and `rotary`: sandwich_layer.py, the whole layer as one hc_decoder_layer call) reserves its
token's cache slot and hands back
its call's arguments instead of running it; consecutive such layers then run in one call, layer i + 1 reading the
buffer layer i writes. Any other layer, a layer with module hooks, or a layer whose kernel declines after reserving
ends the run: the pending layers run first, then that layer as a module call (its separate path writing the slot it
reserved). The same kernels in the same order as the per-layer calls, so the same numbers; a failure raises inside
the Cache's open block, which the caller aborts (every reservation dropped, nothing the cache holds changed).

A layer's record starts from its binding (`accel.binding(x, cache_layer)`: the checks of its modules and the memo
keys over every weight and norm it reads, ~1 ms a step on Gemma 3 270M with int8 weights, ~8% of the step). Inside
`steady()`, a stretch of steps between which no code but ours runs (generate without the user's logits processors,
stopping criteria, streamer or forward hooks), the modules cannot change, so each layer is bound at its first step
and the binding kept; what depends on the step (hooks, the cache's slot, the tensors' checks) is checked each step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn.modules import module as _module

from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.layers.sandwich import SandwichAccel
from hybridcache.accel.native.decoder_stack import call_records, record_type
from hybridcache.accel.native.kernel_calls import takes
from hybridcache.accel.native.layer_program import CODES, call_program

_STEADY: ContextVar[dict | None] = ContextVar("hybridcache_steady_decode", default=None)
_UNSET = object()
_LAYER = CODES["decoder_layer"]  # a whole attention layer's record (hc_decoder_layer)


@contextmanager
def steady() -> Iterator[None]:
    """Decode steps between which the modules stay as they are (no code but ours runs between them): each layer's
    binding is made once and kept until the `with` exits. Anything that may change a module (a weight, a norm, a
    projection, a hook's target) must run outside it."""
    token = _STEADY.set({})
    try:
        yield
    finally:
        _STEADY.reset(token)


def steady_bindings() -> dict | None:
    """The bindings kept inside `steady()` (None outside it: the modules may change between steps)."""
    return _STEADY.get()


def steady_unless_hooked(ours: bool, *models: nn.Module | None) -> AbstractContextManager:
    """`steady()` for a loop that runs no code of the user's between its steps (`ours`: no processor, criterion
    or streamer) when no forward hook of these models (None: none) or global hook would run any either; else a
    context that does nothing (every step binds)."""
    return steady() if ours and _unhooked(*models) else nullcontext()


def _unhooked(*models: nn.Module | None) -> bool:
    """Whether no module of these models (None: none) and no global hook would run the user's code in a step."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    return not any(
        m._forward_hooks or m._forward_pre_hooks for model in models if model is not None for m in model.modules()
    )


def layer_accel(block: nn.Module) -> SandwichAccel | None:
    """The block's fast path when it records its whole layer (None: it does not)."""
    fast = block.__dict__.get("accel")  # (a plain attribute: no nn.Module lookup per layer and step)
    return fast if isinstance(fast, SandwichAccel) else None


def _binding(fast: SandwichAccel, entry, x: torch.Tensor, kept: dict | None):
    """fast.binding(x, entry), made once per (layer, cache layer, x's shape and dtype) inside `steady()`."""
    if kept is None:
        return fast.binding(x, entry)
    key = (id(fast), id(entry), x.shape, x.dtype)
    got = kept.get(key, _UNSET)
    if got is _UNSET or got[0] is not fast or got[1] is not entry:  # (held: neither id is reused while kept)
        got = kept[key] = (fast, entry, fast.binding(x, entry))
    return got[2]


def _hooked(block: nn.Module) -> bool:
    """Whether calling `block` would run hooks that a record's C call would skip."""
    return bool(
        block._forward_hooks
        or block._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def record_accel(block: nn.Module) -> SandwichAccel | PreNormAccel | None:
    """The block's fast path when it records its layer for a many-layer step (None: it does not)."""
    fast = block.__dict__.get("accel")
    return fast if isinstance(fast, (SandwichAccel, PreNormAccel)) else None


def record_step(blocks, entries, h: torch.Tensor, step) -> torch.Tensor | None:
    """h [B, 1, D] through every layer of an eager decode step (blocks[i] with cache layer entries[i]), runs of
    recording layers in one C call each; None (nothing reserved, nothing run) where no layer here records or the
    step is not one the kernels take (the caller's loop then runs it)."""
    if h.dim() != 3 or h.shape[1] != 1 or not takes(h) or torch.compiler.is_compiling() or record_type() is None:
        return None
    accels = [record_accel(b) for b in blocks]
    if not any(accels):
        return None
    bufs = (torch.empty(h.shape, dtype=h.dtype), torch.empty(h.shape, dtype=h.dtype))  # the layers' outputs, in turn
    pending: list[tuple] = []  # (program, the tensors it points into, states for the cache after it) not yet run
    kept, x = _STEADY.get(), h
    for block, fast, entry in zip(blocks, accels, entries, strict=True):
        got = None
        if fast is not None and not _hooked(block):
            binding = _binding(fast, entry, x, kept)
            if binding is not None:
                y = bufs[1] if x is bufs[0] else bufs[0]
                got = fast.record(x, y, entry, step, binding)
                if got is not None and got[0] != "reserved":
                    pending.append(got if isinstance(fast, PreNormAccel) else ([(_LAYER, got[0])], got[1], None))
                    x = y
                    continue
        _flush(pending)
        x = block(x, entry, step) if got is None else fast.separate(x, entry, step, got[1])
    _flush(pending)
    return x


def _flush(pending: list[tuple]) -> None:
    """Run the pending records by one C call (hc_decoder_stack when all are whole attention layers, else
    hc_layer_program), then hand each recurrent layer's new states to its cache layer."""
    if pending:
        program = [op for ops, _alive, _after in pending for op in ops]
        if all(code == _LAYER for code, _ in program):
            call_records([args for _, args in program])  # (`pending` keeps the `_alive` tensors until it returns)
        else:
            call_program(program)
        for _ops, _alive, after in pending:
            if after is not None:
                layer, states = after
                layer.update(**states)
        pending.clear()

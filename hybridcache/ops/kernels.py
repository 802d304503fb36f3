"""The seam through which blocks and ops reach the CPU kernels: `takes(x)` and `call(name, *args)`.

hybridcache.accel plugs its implementations in when it is imported (`import hybridcache` does), so a block asks
this module, never the accelerator: `takes(x)` says whether the kernels serve x (float32 on CPU, no autograd, the
kernels built); `call(name, *args)` runs op `name` on its flat arguments (accel/native/op_declarations.py), eagerly or
as the
registered torch op under torch.compile, and returns None where the kernel does not take them (the caller's torch
path then runs). Before accel plugs in, nothing is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# What the kernels compute, declared here for the blocks' cheap checks (accel asserts its tables agree when it
# plugs in): the projection weights they stream, the activations of the activation x product.
WEIGHT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.int8})
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh", "gelu_new"})


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels serve x (nothing plugged in: never)."""
    return False


def call(name: str, *args):
    """Op `name` on its flat arguments, or None: not taken (nothing plugged in: never)."""
    return None


def plug(takes_fn: Callable[[torch.Tensor], bool], call_fn: Callable[..., object]) -> None:
    """Route `takes` and `call` to the accelerator's (hybridcache.accel does this once, when imported)."""
    global takes, call
    takes, call = takes_fn, call_fn

"""How blocks call a C kernel, the same in eager code and under torch.compile: one decision per place.

A block asks `takes(x)` (float32 on CPU, no autograd, kernels built, plus its own conditions: plain norm / rotary
kinds, shapes the op's declared rules accept) and then `call(name, *args)` with the op's flat arguments
(op_declarations.DECLARATIONS). Eagerly `call` runs the C kernel's wrapper, which returns None for anything it does not
take (the
block then runs its torch path); under torch.compile it puts the registered op `hybridcache::<name>` in the graph,
one opaque call that at run time runs the same wrapper (its declared rules checked first; the pure-torch reference
where the wrapper declines), so compiled decode runs the kernels eager decode runs, with the same rounding.
"""

from __future__ import annotations

import torch

from hybridcache.accel.native.library import kernel_available
from hybridcache.accel.native.op_registry import KERNELS

# The ops traced code calls. An A/B switch for timing: frozenset({"decode_linear"}) gives what compiled decode ran
# before the other ops were traced (their torch paths). Read while tracing, so torch.compile guards on it: each
# value keeps its own compiled graph.
TRACED_OPS = frozenset(KERNELS)
_F32 = torch.float32


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels serve x: float32 on CPU, no autograd, the kernels built here."""
    return x.dtype is _F32 and x.is_cpu and not torch.is_grad_enabled() and kernel_available()


def call(name: str, *args):
    """Op `name` on its flat arguments: eagerly its C kernel's wrapper (None: not taken, use the torch path), under
    torch.compile the registered op (None only for an op left out of TRACED_OPS)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.hybridcache, name).default(*args) if name in TRACED_OPS else None
    return KERNELS[name](*args)

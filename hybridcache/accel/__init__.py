"""The CPU fast path: C kernels built and verified on first use (csrc/), their checked wrappers, and the
`hybridcache::<op>` torch ops (op_registry.py) that blocks call through kernel_calls.py. Everything here has a
pure-torch reference in hybridcache/ops/ or in the blocks; `kernel_status()` says which path runs."""

from hybridcache.accel import op_registry  # noqa: F401, I001 (registers the hybridcache::<op> torch ops first)
from hybridcache.accel.kernels import KernelArgumentError, kernel_status

__all__ = ["KernelArgumentError", "kernel_status"]

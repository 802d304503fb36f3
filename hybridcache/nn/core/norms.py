"""RMSNorm, computed in (at least) float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.ops import kernels

_LOW = (torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, or * (1 + weight) for Gemma-style norms (`unit_offset=True`). The weight multiplies
    the normalised x after the cast back to x's dtype (Llama), or before it with `scale_in_float32=True`
    (Nemotron-H; the same in float32 and float64)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset, self.scale_in_float32 = eps, unit_offset, scale_in_float32
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self._scale: tuple[tuple, torch.Tensor] | None = None

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """(1 + weight) in `dtype`, kept until the weight changes (a decode step would recompute it per norm)."""
        w = _weight(self)
        if torch.compiler.is_compiling():
            return 1.0 + w.to(dtype)
        cached = self._scale
        key = (w.data_ptr(), w._version, dtype)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._scale = (key, 1.0 + w.detach().to(dtype))
        return cached[1]

    def kernel_scale(self) -> torch.Tensor:
        """The float32 vector a kernel multiplies the normalised x by (1 + weight for Gemma-style norms)."""
        return self.scale(torch.float32) if self.unit_offset else _weight(self)

    def kernel_norm(self, x: torch.Tensor) -> bool:
        """Whether x goes to the RMSNorm kernel (eager: its wrapper; compiled: the hybridcache::rms_norm op)."""
        return kernels.takes(x) and x.dim() > 0 and self.weight.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_norm(x):
            # float32 on CPU: one kernel call (every variant below is x * rsqrt(mean(x^2) + eps) * w in float32)
            out = kernels.call("rms_norm", x, self.kernel_scale(), self.eps)
            if out is not None:
                return out
        x32 = x.float() if x.dtype in _LOW else x  # at least float32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        if self.unit_offset:  # Gemma: scale in float32, then cast
            out = normed * (
                self.scale(normed.dtype) if not torch.is_grad_enabled() else 1.0 + self.weight.to(normed.dtype)
            )
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if self.scale_in_float32:
            return (self.weight.to(normed.dtype) * normed).to(x.dtype)
        return self.weight * (
            normed if normed.dtype == x.dtype else normed.to(x.dtype)
        )  # Llama/Mamba: cast, then scale


def _weight(norm: nn.Module) -> torch.Tensor:
    """norm.weight, from `_parameters` when it is a parameter there (nn.Module.__getattr__ costs a call per access,
    several per decode-step layer); otherwise (parametrized, replaced by a plain tensor) the attribute."""
    w = norm._parameters.get("weight")
    return norm.weight if w is None else w


def kernel_plain(norm: nn.Module | None) -> bool:
    """None, or a float32 RMSNorm: what the norm kernels (residual norm, q/k norm with rotary) compute."""
    return norm is None or type(norm) is RMSNorm and _weight(norm).dtype == torch.float32


def kernel_args(norm: nn.Module | None) -> tuple[torch.Tensor | None, float]:
    """A plain norm's (effective float32 scale, eps) as the kernels take them; (None, 0.0) for none."""
    return (None, 0.0) if norm is None else (norm.kernel_scale(), norm.eps)


def residual_norm(
    h: torch.Tensor, x: torch.Tensor, post: nn.Module | None, nxt: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + post(x), nxt(h + post(x))) with `post` / `nxt` None meaning none (h + x; no second output): where a
    decoder layer's branch joins the residual stream and the next branch's pre-norm reads it. One kernel call for
    float32 on CPU when both are plain RMSNorms (the same arithmetic as their own kernel path); the modules otherwise.
    """
    if (
        kernels.takes(x)
        and h.dtype == torch.float32
        and h.shape == x.shape
        and x.dim() > 0
        and kernel_plain(post)
        and kernel_plain(nxt)
    ):
        out = kernels.call("residual_norm", h, x, *kernel_args(post), *kernel_args(nxt))
        if out is not None:
            return out[0], None if nxt is None else out[1]
    h = h + (x if post is None else post(x))
    return h, None if nxt is None else nxt(h)


class WeightlessRMSNorm(nn.Module):
    """x / rms(x) over the last dim in (at least) float32, no weight (HF's `Llama4TextL2Norm`, Gemma 4's
    `with_scale=False` norms)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

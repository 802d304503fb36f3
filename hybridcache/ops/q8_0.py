"""The q8_0 weight format (llama.cpp's block layout) in pure torch: packing, dequantizing, and the linear layer.

A matrix w [N, K] is stored as int8 q [N, K] and a float16 scale [N, K / 32] per block of 32 weights along K
(w ~= q * scale, scale ~= max|block| / 127, see `pack`). The linear layer quantizes its input the same way at run
time (per row and block: d = max|x| / 127 in float32, q = x * (1 / d) rounded to nearest even) and sums the
blocks' products (d_w * d_x) * sum(q_w * q_x): the arithmetic of the C kernel hc_linear_q8_0
(accel/native/csrc/gemv_q8_0.c), here with the blocks' dequantized values in one matmul (the same numbers up to
float32 rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32
_F16_MAX = 65504.0


class Q8FormatError(ValueError):
    """A matrix, scale or input the q8_0 format cannot hold or take (named, raised before any work)."""


def check_pair(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise Q8FormatError unless weight is int8 [N, K] with K a multiple of 32 and scale float16 [N, K / 32]."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise Q8FormatError(f"q8_0 weights must be int8 [N, K], got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if k % BLOCK:
        raise Q8FormatError(f"q8_0 needs in_features divisible by {BLOCK}, got {k}")
    if scale.dtype != torch.float16 or tuple(scale.shape) != (n, k // BLOCK):
        raise Q8FormatError(f"q8_0 scales must be float16 [{n}, {k // BLOCK}], got {scale.dtype} {list(scale.shape)}")


# Candidate block scales max|block| / (127 - t): the one with the least squared error is kept (llama.cpp's q8_0 takes
# t = 0; on Gemma 3 270M this choice took the KL to float32 on the benchmark's prompt from 2.5e-2 to 2.3e-2, the mean
# over its 128 positions, and from 1.7e-2 to 1.3e-2 at its last: experiments/benchmark/standalone/weights_kl.py).
# t >= 0: no weight is clamped beyond the float16 rounding of its scale.
SCALE_CANDIDATES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
_PACK_ROWS = 8192  # rows packed at a time (the candidates' temporaries stay ~100 MB for a 640-wide matrix)


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (q int8 [N, K], scale float16 [N, K / 32]): per block of 32 the scale
    max|block| / (127 - t) of SCALE_CANDIDATES, rounded to float16, with the least squared error of q * scale; an
    all-zero block stays zero."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise Q8FormatError(f"q8_0 needs a matrix with in_features divisible by {BLOCK}, got {list(w.shape)}")
    w = w.detach()
    amax = w.float().unflatten(-1, (-1, BLOCK)).abs().amax(-1)  # [N, G]
    if not bool(torch.isfinite(amax).all()) or bool((amax > 127.0 * _F16_MAX).any()):
        raise Q8FormatError("q8_0 scales are float16: weights must be finite with |w| <= 127 * 65504")
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(amax.shape, dtype=torch.float16, device=w.device)
    for r in range(0, w.shape[0], _PACK_ROWS):
        blocks = w[r : r + _PACK_ROWS].float().unflatten(-1, (-1, BLOCK))  # [n, G, 32]
        best_q, best_s, best_err = None, None, None
        for t in SCALE_CANDIDATES:
            s = (amax[r : r + _PACK_ROWS] / (127.0 - t)).to(torch.float16)
            sf = s.float()
            inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))  # quantized by the stored scale
            cand = torch.round(blocks * inv[..., None]).clamp_(-127, 127)
            err = (cand * sf[..., None] - blocks).square().sum(-1)  # [n, G]
            if best_err is None:
                best_q, best_s, best_err = cand, s, err
                continue
            better = err < best_err
            best_q = torch.where(better[..., None], cand, best_q)
            best_s, best_err = torch.where(better, s, best_s), torch.minimum(err, best_err)
        q[r : r + _PACK_ROWS] = best_q.to(torch.int8).flatten(-2)
        scale[r : r + _PACK_ROWS] = best_s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., K] int8, scale [..., K / 32] float16 -> [..., K] in `dtype` (one rounding: q * scale)."""
    return (q.to(dtype).unflatten(-1, (-1, BLOCK)) * scale.to(dtype)[..., None]).flatten(-2)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float32 -> (integer values [..., K] in x's dtype, scale d [..., K / 32]) as the kernel rounds."""
    blocks = x.unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]).flatten(-2), d


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (q8_0 weight [N, K], scale [N, K / 32])^T (+ bias [N]) -> [..., N] in x's dtype, with x
    quantized per block of 32 as the kernel does."""
    check_pair(weight, scale)
    if x.shape[-1] != weight.shape[1]:
        raise Q8FormatError(f"input has {x.shape[-1]} features, the q8_0 weight {weight.shape[1]}")
    qx, dx = quantize_activations(x)
    xq = dequantize(qx, dx, x.dtype)
    return F.linear(xq, dequantize(weight, scale, x.dtype), bias)

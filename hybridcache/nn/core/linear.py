"""Linear layers for fast decode: the CPU weight-streaming kernel for few rows, and packed weight formats.

`linear(x, weight, bias, scale)` is the one place a projection is computed: the kernels of
hybridcache/accel/native/kernels.py for float32 rows on CPU without autograd (the weight-streaming kernel for a decode
step's few rows, the GEMM kernel for a prefill; under torch.compile the hybridcache::decode_linear op that runs
them), torch's F.linear otherwise (GPU, float64, autograd).
`from_pretrained` switches every nn.Linear to `DecodeLinear`, which calls it.

Packed weights (`from_pretrained(..., weights="bfloat16" | "int8" | "q8_0")`) store the projection matrices in fewer
bytes while everything else (activations, norms, states, the cache, the sums) stays in the model's dtype:
- `bfloat16`: each weight rounded to bfloat16 (8 significant bits); half the bytes of float32.
- `int8`: symmetric per output row, w ~= q * scale with scale = max|row| / 127; a quarter of the bytes.
- `q8_0`: llama.cpp's block layout, int8 with a float16 scale per block of 32 weights along the input
  (scale [N, K / 32], 17/64 of the bytes); the input is quantized per block too at run time (hybridcache/ops/q8_0.py),
  so the kernel sums int8 x int8 products. A matrix whose in_features is not a multiple of 32 is packed as `int8`.
A decode step reads every weight once, so it gets up to 2x / 4x faster; the outputs change (what
`experiment=correctness` measures against the unpacked reference). A tied embedding keeps sharing the head's
packed matrix (its lookups are dequantized rows), so the float32 copy is not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.ops import kernels, q8_0

WEIGHT_FORMATS = ("bfloat16", "int8", "q8_0")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (* scale [N], for int8 weights) (+ bias [N]) -> [..., N] in x's dtype; a 2-D
    scale [N, K / 32] (float16) makes the weight q8_0."""
    if scale is not None and scale.dim() == 2:
        if kernels.takes(x) and x.dim() > 0:
            out = kernels.call("decode_linear_q8_0", x, weight, bias, scale)
            if out is not None:
                return out
        return q8_0.linear(x, weight, scale, bias)
    if kernels.takes(x) and x.dim() > 0 and weight.dim() == 2 and weight.dtype in kernels.WEIGHT_DTYPES:
        # the same kernels eager and compiled (same rounding); packed weights are never unpacked into memory
        out = kernels.call("decode_linear", x, weight, bias, scale)
        if out is not None:
            return out
    return reference_linear(x, weight, bias, scale)


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch path: weights widened to x's dtype, F.linear, then the per-row scale and the bias (q8_0: its own)."""
    if scale is not None and scale.dim() == 2:
        return q8_0.linear(x, weight, scale, bias)
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    if scale is None:
        return F.linear(x, w, bias)
    out = F.linear(x, w) * scale.to(x.dtype)
    return out if bias is None else out + bias


# The hybridcache namespace (its ops, hybridcache::decode_linear among them: accel/native/op_registry.py).
_LIBRARY = torch.library.Library("hybridcache", "DEF")


class DecodeLinear(nn.Linear):
    """nn.Linear through `linear`: the decode kernel for few rows on CPU, an optional `scale` (int8 per row, q8_0 per
    block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._buffers.get("scale"))


def use_decode_linear(model: nn.Module) -> int:
    """Switch every plain nn.Linear of `model` to `DecodeLinear`, in place (same parameters); returns how many."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            module._buffers.setdefault("scale", None)
            switched += 1
    return switched


class PackedEmbedding(nn.Embedding):
    """An embedding that shares a packed (bfloat16 / int8 / q8_0) head matrix: rows are widened to `out_dtype` and
    scaled (int8 per row, q8_0 per block) on lookup."""

    out_dtype: torch.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight, self.padding_idx).to(self.out_dtype)
        scale = self._buffers.get("scale")
        if scale is not None and scale.dim() == 2:  # q8_0: [.., K / 32] blocks
            return q8_0.dequantize(rows, F.embedding(ids, scale), self.out_dtype)
        return rows if scale is None else rows * scale[ids].unsqueeze(-1).to(self.out_dtype)


def pack_matrix(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (packed [N, K], per-row float32 scale [N] for int8, float16 [N, K / 32] for q8_0, else None);
    q8_0 of a K that is not a multiple of 32 is int8 with its per-row scale."""
    if fmt == "bfloat16":
        return w.to(torch.bfloat16), None
    if fmt == "q8_0" and w.shape[1] % q8_0.BLOCK == 0:
        return q8_0.pack(w)
    # int8 (and q8_0's fallback for an input width that is not a multiple of 32, as llama.cpp falls back per tensor)
    absmax = w.detach().abs().amax(dim=1).float()
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))  # an all-zero row stays zero
    q = torch.round(w.detach().float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_weights(model: nn.Module, fmt: str) -> int:
    """Store every projection matrix of `model` in `fmt` (WEIGHT_FORMATS), in place; returns how many matrices.

    Fused groups (q/k/v, gate/up) are packed as one matrix, their members' weights staying row blocks of it;
    embeddings that share a packed matrix (tied heads) share the packed one."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(
            f"weights must be one of {', '.join(WEIGHT_FORMATS)} (or None: the model's dtype), got {fmt!r}"
        )
    compute = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if compute != torch.float32:
        raise ValueError(
            f"packed weights need a float32 model (the decode kernel computes in float32), this one is {compute}"
        )
    use_decode_linear(model)  # every projection must read its scale
    packed: dict[int, tuple[nn.Parameter, nn.Parameter, torch.Tensor | None]] = {}  # id(old) -> (old, new, scale)
    count = 0
    for module in model.modules():
        groups = getattr(module, "projection_groups", None)
        for group in groups() if groups is not None else ():
            if group.fused:
                old = [lin.weight for lin in group.linears]
                group.pack(fmt)
                for w, lin in zip(old, group.linears):
                    packed[id(w)] = (w, lin.weight, lin._buffers.get("scale"))
                count += 1
    done = {id(new) for _, new, _ in packed.values()}  # the fused groups' members hold packed rows already
    for module in list(model.modules()):
        if isinstance(module, nn.Linear) and id(module.weight) not in packed and id(module.weight) not in done:
            if not isinstance(module, DecodeLinear):
                module.__class__ = DecodeLinear
            q, scale = pack_matrix(module.weight, fmt)
            old = module.weight
            module.weight = nn.Parameter(q, requires_grad=False)
            module._buffers["scale"] = scale
            packed[id(old)] = (old, module.weight, scale)
            done.add(id(module.weight))
            count += 1
    for module in list(model.modules()):  # every remaining holder of a packed matrix: tied heads and embeddings
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in packed:
                _, weight, scale = packed[id(param)]
                module._parameters[name] = weight
                if isinstance(module, nn.Embedding):
                    module.__class__ = PackedEmbedding
                    module.out_dtype = compute
                    module._buffers["scale"] = scale
                elif isinstance(module, nn.Linear):
                    module._buffers["scale"] = scale
    model._compute_dtype = compute
    return count

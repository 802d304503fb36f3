"""`storage: int8`: keys and values as int8 with absmax scales, for any attention pattern.

Quantization is symmetric and per group: each token's vector of one head is cut into groups of `q_group_size`
elements along head_dim (default: the whole vector, one scale per token and head; `q_group_size: 32` gives 8 scales
for head_dim 256), and each group is stored as round(x / scale) with scale = max|x| / 127 over the group, in the
layer's dtype. Lossy: every element is off by at most half a step, scale / 2 (plus the dtype's rounding of the
product when the layer's dtype is lower than float32). `GroupQuantCodec` is the shared code; int4_storage.py packs
4-bit values two to a byte on top of it. Written as a plugin would be: one codec class.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.storage.codecs import KVCodec, register_kv_codec


class GroupQuantCodec(KVCodec):
    """Symmetric absmax quantization to `bits` bits in groups of `q_group_size` along head_dim.

    Parts: `q` (the integers, [.., D] int8 unless a subclass packs them) and `scale` ([.., D / q_group_size] in the
    layer's dtype). Error per element <= scale / 2 with scale = max|x| over its group / (2^(bits-1) - 1).
    """

    exact = False
    options = ("q_group_size",)
    bits: ClassVar[int] = 8
    default_group: ClassVar[int | None] = None  # None: the whole head_dim; else the largest divisor of head_dim <= it

    def __init__(self, q_group_size: int | None = None) -> None:
        g = q_group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise CacheConfigError(f"storage '{self.name}': q_group_size must be a positive integer, got {g!r}")
        self.q_group_size = q_group_size

    @property
    def levels(self) -> int:
        """Largest stored magnitude: 127 for int8, 7 for int4 (symmetric, so zero is exact)."""
        return 2 ** (self.bits - 1) - 1

    def group(self, head_dim: int) -> int:
        """Elements per scale for vectors of `head_dim` elements."""
        if self.q_group_size is not None:
            return self.q_group_size
        if self.default_group is None:
            return head_dim
        return max(g for g in range(1, min(self.default_group, head_dim) + 1) if head_dim % g == 0)

    def check(self, head_dim: int, dtype: torch.dtype) -> None:
        g = self.group(head_dim)
        if head_dim % g:
            raise CacheConfigError(f"storage '{self.name}': q_group_size {g} does not divide head_dim {head_dim}")

    def fields(self, head_dim, dtype):
        return {"q": ((head_dim,), torch.int8), "scale": ((head_dim // self.group(head_dim),), dtype)}

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [.., D] -> integers in [-levels, levels] [.., D] (int8) and scales [.., D / group] in x's dtype."""
        d = x.shape[-1]
        g = self.group(d)
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()  # no rounding of x / scale in bf16
        groups = work.unflatten(-1, (d // g, g))  # [.., G, g]
        tiny = torch.finfo(x.dtype).tiny
        scale = (groups.abs().amax(-1) / self.levels).clamp(min=tiny).to(x.dtype)  # stored scale [.., G]
        q = torch.round(groups / scale.to(work.dtype)[..., None]).clamp(-self.levels, self.levels)
        return q.flatten(-2).to(torch.int8), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Integers [.., D] and scales [.., G] -> values [.., D] in `dtype`."""
        groups = q.unflatten(-1, (scale.shape[-1], -1)).to(dtype)
        return (groups * scale.to(dtype)[..., None]).flatten(-2)

    def encode(self, x):  # x [B, H, T, D]
        q, scale = self.quantize(x)
        return {"q": q, "scale": scale}

    def decode(self, parts, dtype):
        return self.dequantize(parts["q"], parts["scale"], dtype)


@register_kv_codec("int8")
class Int8Codec(GroupQuantCodec):
    output_error_bound = 0.1  # max |attention output error| on unit-normal keys/values (the conformance kit's data)
    bits = 8

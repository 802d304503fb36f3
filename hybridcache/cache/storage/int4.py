"""`storage: int4`: keys and values as 4-bit integers with one absmax scale per group of `q_group_size` elements.

Groups run along head_dim (default 32, or the largest divisor of head_dim up to 32; `q_group_size` in the cache config
changes it, and must divide head_dim). Each group is stored as round(x / scale) in [-7, 7] with scale = max|x| / 7
over the group, two values per byte (the low nibble holds the even element), the scale in the layer's dtype. Per
token and head that is D / 2 bytes + D / q_group_size scales: 160 bytes for head_dim 256 in float32 (dense: 1024), so
memory accounting shows the real saving. Lossy: every element is off by at most scale / 2 of its group (plus the
dtype's rounding of the product below float32). KIVI quantizes keys per channel; here keys and values are both
quantized per token, so any split of a sequence stores the same integers (add `residual: R` to keep the most recent
R tokens unquantized as well, see residual_window.py). Written as a plugin would be: one codec class.
"""

from __future__ import annotations

import torch

from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.storage.codecs import register_kv_codec
from hybridcache.cache.storage.int8 import GroupQuantCodec


@register_kv_codec("int4")
class Int4Codec(GroupQuantCodec):
    output_error_bound = 1.0  # max |attention output error| on the kit's unit-normal data (head_dim 8: measured 0.42)
    bits = 4
    default_group = 32

    def check(self, head_dim, dtype):
        super().check(head_dim, dtype)
        if head_dim % 2:
            raise CacheConfigError(
                f"storage 'int4' packs two values per byte and needs an even head_dim, got {head_dim}"
            )

    def fields(self, head_dim, dtype):
        return {"q": ((head_dim // 2,), torch.uint8), "scale": ((head_dim // self.group(head_dim),), dtype)}

    def encode(self, x):  # x [B, H, T, D]
        q, scale = self.quantize(x)
        nibbles = (q + 8).to(torch.uint8).unflatten(-1, (-1, 2))  # [.., D/2, 2] in [1, 15]
        return {"q": nibbles[..., 0] | (nibbles[..., 1] << 4), "scale": scale}

    def decode(self, parts, dtype):
        packed = parts["q"]
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int8) - 8  # [.., D]
        return self.dequantize(q, parts["scale"], dtype)

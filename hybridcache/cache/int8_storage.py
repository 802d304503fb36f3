"""`storage: int8`: keys and values as int8 with one scale per token and head (absmax), for any attention pattern.

Lossy: each element is off by at most half a quantization step, max|x| / 254 for its token and head.
Written as a plugin would be: one codec class.
"""

import torch

from hybridcache.cache.kv_codecs import KVCodec, register_kv_codec


@register_kv_codec("int8")
class Int8Codec(KVCodec):
    exact = False
    output_error_bound = 0.1  # max |attention output error| on unit-normal keys/values (the conformance kit's data)

    def fields(self, head_dim, dtype):
        return {"q": ((head_dim,), torch.int8), "scale": ((1,), dtype)}

    def encode(self, x):  # x [B, H, T, D]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / 127
        return {"q": torch.round(x / scale).clamp(-127, 127).to(torch.int8), "scale": scale}

    def decode(self, parts, dtype):
        return parts["q"].to(dtype) * parts["scale"].to(dtype)

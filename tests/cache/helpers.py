"""Small builders shared by the cache tests."""

import torch

from hybridcache.cache import Cache, NativeLayer

ATTN = dict(num_kv_heads=2, head_dim=4)
NATIVE = {
    "full": NativeLayer("full", ATTN),
    "sliding": NativeLayer("sliding", {**ATTN, "window": 4}),
    "chunked": NativeLayer("chunked", {**ATTN, "chunk_size": 3}),
    "mamba": NativeLayer("mamba", dict(intermediate_size=6, state_size=3, conv_kernel=4)),
    "mamba2": NativeLayer("mamba2", dict(num_heads=2, head_dim=3, state_size=4, n_groups=1, conv_kernel=4)),
    "rglru": NativeLayer("rglru", dict(lru_width=5, conv_kernel=4)),
    "conv": NativeLayer("conv", dict(channels=5, conv_kernel=3)),
}


def hybrid_cache(batch=2, max_length=None, types=tuple(NATIVE)):
    return Cache.build([NATIVE[t] for t in types], batch, max_length=max_length)


def feed_layer(layer, tokens, g):
    """Feed one cache layer (inside an open block) random keys/values or states."""
    b = layer.batch_size
    if layer.kind == "attention":
        s = layer.spec
        k = torch.randn(b, s.num_kv_heads, tokens, s.head_dim, generator=g)
        return layer.update(k, torch.randn(k.shape, generator=g))
    states = {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in layer.states.items()}
    return layer.update(**states)


def feed(cache, tokens, valid=None, seed=0):
    """Advance every layer of `cache` by one block of random keys/values/states."""
    g = torch.Generator().manual_seed(seed)
    with cache.block(valid, tokens):
        for layer in cache.layers:
            feed_layer(layer, tokens, g)


def in_block(cache, tokens, call, valid=None):
    """Run `call()` (feeding layers) inside one block of `cache`."""
    with cache.block(valid, tokens):
        call()


def state_equal(a, b):
    """Bit-exact equality of two cache snapshots."""
    if len(a.layers) != len(b.layers):
        return False
    if a.columns != b.columns or not torch.equal(a.seen, b.seen):
        return False
    for x, y in zip(a.layers, b.layers):
        if x.columns != y.columns or x.tensors.keys() != y.tensors.keys():
            return False
        for name in x.tensors:
            if x.tensors[name].shape != y.tensors[name].shape or not torch.equal(x.tensors[name], y.tensors[name]):
                return False
    return True

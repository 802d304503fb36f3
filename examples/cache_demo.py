"""A hybrid cache in action: a Jamba-like stack under three cache strategies, 4,096 tokens, memory per type."""

import torch
from rich.console import Console

from hybridcache.cache import Cache, NativeLayer
from hybridcache.report import memory_table

BATCH, PROMPT, DECODE = 2, 4000, 96
attn = {"num_kv_heads": 8, "head_dim": 64}
mamba = {"intermediate_size": 2048, "state_size": 16, "conv_kernel": 4}
native = [NativeLayer("mamba", mamba)] * 3 + [NativeLayer("full", attn)]  # Jamba's 1:3 attention:mamba ratio
native = native * 2

STRATEGIES = {
    "native": None,
    "hybrid_sliding (full layers: window 64)": {"full": {"type": "sliding", "window": 64}},
    "hybrid_chunked (full layers: chunk 64)": {"full": {"type": "chunked", "chunk_size": 64}},
}


def run(cache: Cache) -> None:
    """Prefill a prompt in 512-token chunks, then decode token by token (random keys, values and states)."""
    g = torch.Generator().manual_seed(0)
    for block in [512] * (PROMPT // 512) + [PROMPT % 512] + [1] * DECODE:
        with cache.block(tokens=block):  # every layer advances together
            for layer in cache:
                if layer.kind == "attention":
                    k = torch.randn(BATCH, 8, block, 64, generator=g)
                    layer.update(k, k)
                else:
                    layer.update(block, **{n: torch.randn(t.shape, generator=g) for n, t in layer.states.items()})


console = Console()
for name, config in STRATEGIES.items():
    cache = Cache.build(native, BATCH, config)
    run(cache)
    console.rule(name)
    console.print(memory_table(cache))

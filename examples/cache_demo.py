"""A hybrid cache in action: a Jamba-like stack under three cache strategies, 4,096 tokens, memory per type."""

import torch
from rich.console import Console

from hybridcache.cache import Cache, NativeLayer
from hybridcache.tools.report import memory_table

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


def run(cache: Cache, prompt: int = PROMPT, decode: int = DECODE) -> None:
    """Prefill a prompt in 512-token chunks, then decode token by token (random keys, values and states)."""
    g = torch.Generator().manual_seed(0)
    blocks = [512] * (prompt // 512) + ([prompt % 512] if prompt % 512 else []) + [1] * decode
    for block in blocks:
        with cache.block(tokens=block):  # every layer advances together
            for layer in cache:
                if layer.kind == "attention":
                    k = torch.randn(cache.batch_size, 8, block, 64, generator=g)
                    layer.update(k, k)
                else:
                    layer.update(block, **{n: torch.randn(t.shape, generator=g) for n, t in layer.states.items()})


def chunked_notes(cache: Cache) -> list[str]:
    """What a chunked layer holds and why: its current chunk's tokens, which is none right after a chunk completes."""
    notes = []
    for layer in cache:
        if layer.type_name != "chunked":
            continue
        size, seen = layer.spec.chunk_size, cache.columns
        current = seen % size
        if current == 0:
            why = (
                f"0 B: token {seen:,} completed chunk {seen // size} (chunk size {size}); a token attends only inside "
                "its own chunk, so the finished chunk is never read again and is dropped; the next token starts a new "
                f"chunk (1 to {size} tokens held from then on)"
            )
        else:
            why = f"the {current} tokens of the current chunk {seen // size + 1} (chunk size {size}, {seen:,} seen)"
        notes.append(f"chunked: holds {why}")
        break  # every chunked layer of this stack sees the same tokens
    return notes


if __name__ == "__main__":
    console = Console()
    for name, config in STRATEGIES.items():
        cache = Cache.build(native, BATCH, config)
        run(cache)
        console.rule(name)
        console.print(memory_table(cache))
        for note in chunked_notes(cache):
            console.print(note, soft_wrap=True)

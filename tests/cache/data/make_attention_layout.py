"""Writes attention_layout_v1.safetensors: the tensors attention cache layers save (names, dtypes, shapes, values)
after a fixed feed of seeded random keys and values, one scenario per storage kind. Written by the code before the
attention storages became objects (commit 7d1ca1b: the layer switched storage modes by fields), so that
tests/cache/test_attention_storage.py checks the save format (and the stored values) did not change.

    HYBRIDCACHE_HOME=... PYTHONPATH=<checkout> python tests/cache/data/make_attention_layout.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.core.errors import CacheCropError

HEADS, DIM, BATCH = 2, 8, 2
NATIVE = [
    NativeLayer("full", dict(num_kv_heads=HEADS, head_dim=DIM)),
    NativeLayer("sliding", dict(num_kv_heads=HEADS, head_dim=DIM, window=5)),
]
# scenario -> (cache config, max_length)
SCENARIOS = {
    "dense": ({}, None),
    "dense_static": ({}, 24),
    "int8": ({"attention": {"storage": "int8"}}, None),
    "int8_residual": ({"attention": {"storage": "int8", "residual": 3}}, None),
    "int8_residual_static": ({"attention": {"storage": "int8", "residual": 3}}, 24),
    "int4_chunked": ({"attention": {"type": "chunked", "chunk_size": 4, "storage": "int4", "q_group_size": 8}}, None),
    "sink_int8": ({"attention": {"type": "sink", "window": 4, "sinks": 2, "storage": "int8"}}, None),
    "kivi": ({"attention": {"storage": "kivi", "q_group_size": 4, "residual": 4}}, None),
    "hf_quantized": ({"attention": {"storage": "hf_quantized", "q_group_size": 4, "residual": 4}}, None),
    "offload": ({"attention": {"storage": "offload"}}, None),
    "offload_static": ({"attention": {"storage": "offload"}}, 24),
}
BLOCKS = [5, 1, 1, 3, 1, 1, 4, 1, 1]  # the first block left-pads row 1 by 2


def run(config, max_length, native=NATIVE):
    """{"<step>.<layer>.<name>": tensor} after the feed, after a crop by 2 columns (where exact), after select."""
    cache = Cache.build(native, BATCH, config, max_length=max_length)
    g = torch.Generator().manual_seed(0)
    for i, tokens in enumerate(BLOCKS):
        valid = None
        if i == 0:
            valid = torch.ones(BATCH, tokens, dtype=torch.bool)
            valid[1, :2] = False
        with cache.block(valid, tokens):
            for layer in cache.layers:
                k = torch.randn(BATCH, HEADS, tokens, DIM, generator=g)
                layer.update(k, torch.randn(k.shape, generator=g))
    out = {}

    def record(step):
        for j, layer in enumerate(cache.layers):
            for name, t in layer._state_tensors().items():
                out[f"{step}.{j}.{name}"] = t.detach().clone().contiguous()

    record("fed")
    try:
        cache.crop(cache.columns - 2)
        record("cropped")
    except CacheCropError:  # (a sliding window holds only what its pattern needs)
        pass
    cache.select(torch.tensor([1, 0, 1]))
    record("selected")
    return out


def main():
    tensors = {}
    for scenario, (config, max_length) in SCENARIOS.items():
        for key, t in run(config, max_length).items():
            tensors[f"{scenario}.{key}"] = t
        for key, t in run(config, max_length, NATIVE[:1]).items():  # the full layer alone: crops are exact
            tensors[f"{scenario}.full_only.{key}"] = t
    save_file(tensors, str(Path(__file__).with_name("attention_layout_v1.safetensors")))


if __name__ == "__main__":
    main()

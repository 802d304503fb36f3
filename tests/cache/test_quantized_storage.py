"""int4 / int8 storage with per-group scales: error bounds against an independent float computation, packing by
hand, bytes per token by hand, composition with every pattern (conformance kit) and bad configs."""

import itertools

import numpy as np
import pytest
import torch

from hybridcache.cache import Cache, CacheError, NativeLayer, get_codec, resolve_plan
from hybridcache.testing import check_cache_type


def grouped_reference(x: np.ndarray, group: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent absmax quantization in float64 numpy: (dequantized x, per-element scale)."""
    out, scales = np.empty_like(x), np.empty_like(x)
    d = x.shape[-1]
    for row, dst, sc in zip(x.reshape(-1, d), out.reshape(-1, d), scales.reshape(-1, d)):
        for start in range(0, len(row), group):
            g = row[start : start + group]
            scale = max(abs(float(v)) for v in g) / levels
            dst[start : start + group] = [round(float(v) / scale) * scale for v in g]  # round half to even, as torch
            sc[start : start + group] = scale
    return out, scales


def spiky(shape, seed):
    """Unit-normal data with a few large outliers and some all-small groups (what per-group scales are for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[..., 3] *= 40.0
    x[..., -8:] *= 1e-3
    return x


@pytest.mark.parametrize(
    "storage,levels,group",
    [("int4", 7, 8), ("int4", 7, 16), ("int4", 7, 32), ("int4", 7, 64), ("int8", 127, 8), ("int8", 127, 64)],
)
def test_error_is_at_most_half_a_step_of_its_group(storage, levels, group):
    x = spiky((2, 3, 5, 64), seed=group)
    codec = get_codec(storage, q_group_size=group)
    codec.check(64, torch.float64)
    parts = codec.encode(x)
    assert parts["scale"].shape == (2, 3, 5, 64 // group)
    got = codec.decode(parts, torch.float64).numpy()
    want, scale = grouped_reference(x.numpy(), group, levels)
    err = np.abs(got - x.numpy())
    assert (err <= scale / 2 * (1 + 1e-12)).all()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)  # the same integers as the independent computation
    assert err.max() > 0  # lossy indeed


def test_per_group_scales_beat_one_scale_per_token_on_outliers():
    x = spiky((1, 2, 6, 64), seed=0)
    per_token = get_codec("int8")  # the default: one scale per token and head, as before
    per_group = get_codec("int8", q_group_size=8)
    assert per_token.encode(x)["scale"].shape[-1] == 1
    e_token = (per_token.decode(per_token.encode(x), torch.float64) - x).abs()[..., -8:].max()
    e_group = (per_group.decode(per_group.encode(x), torch.float64) - x).abs()[..., -8:].max()
    assert e_group < e_token / 100  # the small tail no longer shares a scale with the outlier


def test_int4_packs_two_values_per_byte_by_hand():
    codec = get_codec("int4", q_group_size=4)
    x = torch.tensor([1.0, -0.6, 0.3, 0.0, 0.0, 0.0, 0.0, 2.0]).view(1, 1, 1, 8)
    parts = codec.encode(x)
    # group 0: scale 1/7, q = round(7x) = [7, -4, 2, 0] -> nibbles q + 8 = [15, 4, 10, 8]; low nibble = even element
    # group 1: scale 2/7, q = [0, 0, 0, 7] -> nibbles [8, 8, 8, 15]
    assert parts["q"].dtype == torch.uint8
    assert parts["q"].flatten().tolist() == [15 | 4 << 4, 10 | 8 << 4, 8 | 8 << 4, 8 | 15 << 4]
    torch.testing.assert_close(parts["scale"].flatten(), torch.tensor([1 / 7, 2 / 7]))
    torch.testing.assert_close(
        codec.decode(parts, torch.float32).flatten(), torch.tensor([1.0, -4 / 7, 2 / 7, 0.0, 0.0, 0.0, 0.0, 2.0])
    )


def test_default_group_is_32_or_the_largest_divisor_below():
    assert get_codec("int4").group(256) == 32 and get_codec("int4").group(8) == 8 and get_codec("int4").group(48) == 24
    assert get_codec("int8").group(256) == 256  # int8 default: one scale per token and head


GEMMA = {"num_kv_heads": 1, "head_dim": 256}  # Gemma 3 270M's attention layers (float32)


@pytest.mark.parametrize(
    "params,token_bytes",
    [
        ({}, 2 * 256 * 4),  # dense: key + value, 256 float32 each
        ({"storage": "int8"}, 2 * (256 + 4)),  # 256 int8 + one float32 scale
        ({"storage": "int8", "q_group_size": 32}, 2 * (256 + 8 * 4)),
        ({"storage": "int4"}, 2 * (128 + 8 * 4)),  # 128 bytes of nibbles + 8 scales (group 32)
        ({"storage": "int4", "q_group_size": 64}, 2 * (128 + 4 * 4)),
        ({"storage": "offload"}, 2 * 256 * 4),
    ],
)
def test_bytes_per_token_by_hand(params, token_bytes):
    plan = resolve_plan([NativeLayer("full", GEMMA)], {"attention": params})
    assert plan[0].spec.token_nbytes == token_bytes
    for max_length in (None, 64):
        cache = Cache.from_plan(resolve_plan([NativeLayer("full", GEMMA)], {"attention": params}, max_length), 2)
        g = torch.Generator().manual_seed(0)
        for n in (5, 1, 1, 20):
            with cache.block(None, n):
                cache[0].update(*(torch.randn(2, 1, n, 256, generator=g) for _ in range(2)))
        held = 2 * (max_length or 27) * token_bytes
        assert cache.nbytes() == held == cache.plan.held_nbytes(2, 27)


@pytest.mark.parametrize(
    "pattern,params,storage,group",
    [
        (p, q, s, g)
        for (p, q), (s, g) in itertools.product(
            [("full", {}), ("sliding", {"window": 5}), ("chunked", {"chunk_size": 4})],
            [("int4", 4), ("int4", 2), ("int8", 4)],
        )
    ],
)
def test_non_default_groups_pass_the_kit_on_every_pattern(pattern, params, storage, group):
    counts = check_cache_type(pattern, params={**params, "storage": storage, "q_group_size": group}, cases=4)
    assert counts["split == one-shot"] == 8


BAD = [
    ({"storage": "int4", "q_group_size": 3}, "q_group_size 3 does not divide head_dim 8"),
    ({"storage": "int8", "q_group_size": 16}, "q_group_size 16 does not divide head_dim 8"),
    ({"storage": "int4", "q_group_size": 0}, "q_group_size must be a positive integer, got 0"),
    ({"storage": "int4", "q_group_size": -4}, "q_group_size must be a positive integer, got -4"),
    ({"storage": "int4", "q_group_size": 2.0}, "q_group_size must be a positive integer, got 2.0"),
    ({"q_group_size": 4}, "storage 'dense' does not take q_group_size .it takes no options"),
    ({"storage": "offload", "q_group_size": 4}, "storage 'offload' does not take q_group_size"),
    (
        {"storage": "int2"},
        r"unknown attention storage 'int2'; known: (\w+, )*dense, (\w+, )*int4, int8, (\w+, )*offload",
    ),
]


@pytest.mark.parametrize("entry,message", BAD)
def test_bad_storage_configs_fail_clearly(entry, message):
    with pytest.raises(CacheError, match=message):
        resolve_plan([NativeLayer("full", {"num_kv_heads": 2, "head_dim": 8})], {"attention": entry})


def test_int4_needs_an_even_head_dim():
    with pytest.raises(CacheError, match="needs an even head_dim, got 7"):
        resolve_plan([NativeLayer("full", {"num_kv_heads": 2, "head_dim": 7})], {"attention": {"storage": "int4"}})

"""Cached attention in any split equals naive whole-sequence attention with the same pattern."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridcache.cache import ChunkedSpec, FullSpec, SlidingSpec, get_layer_class
from tests.cache.oracle import masked_attention, naive_attention, row_positions

SPECS = {"full": FullSpec, "sliding": SlidingSpec, "chunked": ChunkedSpec}
PARAM = {"sliding": "window", "chunked": "chunk_size"}


def make_layer(pattern, param, heads, dim, batch, max_length=None):
    extra = {PARAM[pattern]: param} if pattern in PARAM else {}
    spec = SPECS[pattern](num_kv_heads=heads, head_dim=dim, max_length=max_length, **extra)
    return get_layer_class(pattern)(spec, batch)


@st.composite
def scenarios(draw):
    pattern = draw(st.sampled_from(["full", "sliding", "chunked"]))
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(1, 36))
    pads = [draw(st.integers(0, n - 1)) for _ in range(batch)]
    if draw(st.booleans()):  # a prefill then single-token decode steps
        first = draw(st.integers(1, n))
        cuts = list(range(first, n))
    else:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    static = draw(st.booleans())
    return dict(
        pattern=pattern,
        param=draw(st.integers(1, 9)),
        batch=batch,
        heads=draw(st.integers(1, 2)),
        dim=draw(st.sampled_from([2, 4])),
        n=n,
        pads=pads,
        bounds=[0, *cuts, n],
        max_length=n + draw(st.integers(0, 3)) if static else None,
        seed=draw(st.integers(0, 2**16)),
    )


def check_split(pattern, param, batch, heads, dim, n, pads, bounds, max_length, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g) for _ in range(3))
    valid = torch.tensor(row_positions(pads, n)) >= 0  # [B, N]
    expected, _ = naive_attention(q, k, v, pads, pattern, param)
    layer = make_layer(pattern, param, heads, dim, batch, max_length)
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        view = layer.update(k[:, :, c0:c1], v[:, :, c0:c1], valid[:, c0:c1])
        assert view.query_positions.tolist() == [row[c0:c1] for row in row_positions(pads, n)]
        got = masked_attention(q[:, :, c0:c1], view.keys, view.values, view.mask)
        real = valid[:, None, c0:c1, None].expand_as(got)
        diff = (got.double() - expected[:, :, c0:c1]).abs()[real]
        assert diff.numel() == 0 or diff.max() <= 1e-5, (c0, c1, diff.max())
        check_held(layer, pattern, param, max_length)
    assert layer.seen.tolist() == [n - p for p in pads]
    assert layer.columns == n


def check_held(layer, pattern, param, max_length):
    """Storage bounds: dynamic sliding <= W-1 slots, chunked <= C-1; every row holds what its next query needs."""
    slots = layer.keys.shape[2]
    if max_length is None:
        if pattern == "sliding":
            assert slots <= param - 1
        if pattern == "chunked":
            assert slots <= param - 1
    else:
        assert slots == (max_length if pattern == "full" else min(param, max_length))
    pos = layer.key_positions()
    for r, seen in enumerate(layer.seen.tolist()):
        held = set(p for p in pos[r].tolist() if p >= 0)
        if pattern == "full":
            need = set(range(seen))
        elif pattern == "sliding":
            need = set(range(max(0, seen - param + 1), seen))
        else:
            need = set(range(seen // param * param, seen))
        assert need <= held, (r, sorted(need - held))


@given(scenarios())
def test_any_split_matches_naive_attention(s):
    check_split(**s)


def test_long_prompt_then_decode_wraps_ring_many_times():
    for pattern, param in [("sliding", 4), ("chunked", 5), ("full", 1)]:
        n = 57
        check_split(pattern, param, 2, 2, 4, n, [3, 0], [0, 13, *range(14, n), n], max_length=n, seed=1)
        check_split(pattern, param, 2, 2, 4, n, [3, 0], [0, 13, *range(14, n), n], max_length=None, seed=2)


def test_block_longer_than_window_sees_every_key_it_may():
    check_split("sliding", 3, 1, 1, 4, 20, [0], [0, 20], None, seed=3)
    check_split("chunked", 4, 1, 1, 4, 20, [0], [0, 11, 20], 20, seed=4)


def test_mask_values_by_hand():
    """Sliding window 3 over 5 tokens: each query sees itself and the two tokens before it."""
    layer = make_layer("sliding", 3, 1, 2, 1)
    view = layer.update(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2))
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert view.mask[0].int().tolist() == expected
    chunked = make_layer("chunked", 2, 1, 2, 1)
    view = chunked.update(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2))
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert view.mask[0].int().tolist() == expected
    assert chunked.keys.shape[2] == 1  # only token 4, the current chunk, is held

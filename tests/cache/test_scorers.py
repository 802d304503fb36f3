"""The composed attention cache layer (issue 41): a scorer with state carried along the slots, checked against a
plain-Python recompute of its eviction; capabilities declared by class flags; staging as typed records."""

from dataclasses import dataclass

import pytest
import torch

from hybridcache.cache import FullAttentionLayer, FullSpec, SlidingSpec, SlidingWindowLayer, get_layer_class
from hybridcache.cache.attention.staging import BlockWrite, DecodeWrite, GroupedWrite
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer

H, D = 2, 4


@dataclass(frozen=True, kw_only=True)
class AccumulatedKeySpec(ScoredSpec):
    pass


class AccumulatedKey(Scorer):
    """Per slot: its key's first component times the number of queries that saw it, summed over the blocks."""

    slot_state = ("acc",)

    def observe(self, ctx):
        q, pos = ctx.query_positions[:, None, :, None], ctx.slot_positions()[:, :, None, :]
        seeing = ((q >= 0) & (pos >= 0) & (pos <= q)).sum(2)  # [B, H, S]
        return {"acc": ctx.state["acc"] + ctx.keys[..., 0].double() * seeing}

    def score(self, ctx):
        return ctx.state["acc"]


register_press("accumulated_key_test", AccumulatedKeySpec, AccumulatedKey, {"budget": 4, "schedule": "continuous"})


def recompute(keys: torch.Tensor, splits: list[int], budget: int) -> list[list[set[int]]]:
    """Kept positions per row and head after the last block, by plain Python: every held token and the block's
    new ones gain k0 x (queries of the block at or after it); the top `budget` by that sum stay (ties: the later)."""
    b, h, t, _ = keys.shape
    out = []
    for row in range(b):
        heads = []
        for head in range(h):
            acc: dict[int, float] = {}
            start = 0
            for n in splits:
                queries = range(start, start + n)
                for p in range(start, start + n):
                    acc[p] = 0.0
                for p in acc:
                    acc[p] += float(keys[row, head, p, 0]) * sum(1 for q in queries if q >= p)
                kept = sorted(acc, key=lambda p: (acc[p], p), reverse=True)[:budget]
                acc = {p: acc[p] for p in kept}
                start += n
            heads.append(set(acc))
        out.append(heads)
    return out


@pytest.mark.parametrize("splits", [[7], [3, 1, 1, 2], [1] * 7, [2, 5]])
def test_a_scorer_state_follows_the_slots_as_a_recompute_says(splits):
    g = torch.Generator().manual_seed(sum(splits) * 31 + len(splits))
    keys = torch.randn(2, H, sum(splits), D, generator=g, dtype=torch.float64).float()
    spec = AccumulatedKeySpec(num_kv_heads=H, head_dim=D, budget=4, schedule="continuous")
    layer = get_layer_class("accumulated_key_test")(spec, 2)
    start = 0
    for n in splits:
        k = keys[:, :, start : start + n]
        layer.update(k, torch.zeros_like(k))
        start += n
        assert layer.acc.shape == layer.key_pos.shape  # the state is kept next to the slots
    want = recompute(keys, splits, 4)
    pos = layer.key_positions()  # [B, H, S]
    got = [[{int(p) for p in pos[r, h] if p >= 0} for h in range(H)] for r in range(2)]
    assert got == want
    held = pos >= 0  # and each kept slot carries its own token's sum
    k0 = keys[..., 0].double().gather(2, pos.clamp(min=0))  # [B, H, S]
    assert torch.allclose(layer.acc[held], (k0 * (sum(splits) - pos))[held])


def test_a_scorer_state_is_saved_and_selected_with_the_rows():
    spec = AccumulatedKeySpec(num_kv_heads=H, head_dim=D, budget=3, schedule="continuous")
    layer = get_layer_class("accumulated_key_test")(spec, 2)
    layer.update(torch.randn(2, H, 5, D), torch.randn(2, H, 5, D))
    assert "acc" in layer.snapshot().tensors
    before = layer.acc.clone()
    layer.select([1, 1, 0])
    assert torch.equal(layer.acc, before[[1, 1, 0]])


class OwnEviction(FullAttentionLayer):
    evicts = True

    def _evict(self, pos, seen):  # keeps only the even positions: not what the pattern sees
        keep = ((pos >= 0) & (pos % 2 == 0)).any(0)
        return keep.nonzero().squeeze(1)


class OwnUpdate(FullAttentionLayer):
    def update(self, k, v, valid=None):
        return super().update(k, v, valid)


class SaysItWrites(OwnUpdate):
    kernel_writes_slots = True


def test_capabilities_are_class_flags_that_a_subclass_gives_up_by_defining_the_hook():
    assert not FullAttentionLayer.own_eviction and OwnEviction.own_eviction
    assert get_layer_class("snapkv").own_eviction and get_layer_class("h2o").own_eviction
    assert FullAttentionLayer.kernel_writes_slots and not OwnUpdate.kernel_writes_slots
    assert SaysItWrites.kernel_writes_slots  # a class that sets the flag itself keeps what it says
    spec = FullSpec(num_kv_heads=H, head_dim=D)
    assert FullAttentionLayer(spec, 1).writes_slots() and not OwnUpdate(spec, 1).writes_slots()


def test_a_layer_with_its_own_eviction_is_not_skipped_by_the_pattern_shortcuts():
    layer = OwnEviction(FullSpec(num_kv_heads=H, head_dim=D), 1)
    layer.update(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D))
    assert layer.key_positions().tolist() == [[0, 2, 4]]


@pytest.mark.parametrize(
    "params,tokens,record",
    [
        (dict(max_length=8), 1, DecodeWrite),  # preallocated, one token: written in place
        (dict(max_length=8), 3, BlockWrite),
        (dict(), 1, BlockWrite),
        (dict(storage="kivi", q_group_size=4), 2, GroupedWrite),
    ],
)
def test_a_block_is_staged_as_a_typed_record(params, tokens, record):
    layer = SlidingWindowLayer(SlidingSpec(num_kv_heads=H, head_dim=D, window=4, **params), 1)
    with _open(layer, tokens):
        layer.update(torch.randn(1, H, tokens, D), torch.randn(1, H, tokens, D))
        assert isinstance(layer._staged, record) and layer._staged.tokens == tokens


class _open:
    """Open a standalone layer's block by hand, so the staged record can be looked at before the commit."""

    def __init__(self, layer, tokens):
        self.layer, self.tokens = layer, tokens

    def __enter__(self):
        layer = self.layer
        block = layer.seq.make_block(None, self.tokens, layer.name)
        layer.check_block(block)
        layer.seq.block = block

    def __exit__(self, *exc):
        self.layer.commit_block()
        self.layer.seq.commit()

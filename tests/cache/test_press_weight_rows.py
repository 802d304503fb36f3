"""Score-based presses keep only the attention-weight rows their score reads between the attention call and the
block's end (`Scorer.query_rows`: SnapKV / PyramidKV the last window_size queries, TOVA the last one), not every
layer's [B, Hq, T, S] (a long prompt's peak memory). The kept positions equal those scored from the full weights
(the same scorer told to keep every row), on a left-padded batch."""

import pytest
import torch

from hybridcache.cache import Cache, NativeLayer, get_layer_class

B, H, HQ, D, T = 2, 2, 4, 8, 24

CONFIGS = {
    "snapkv": ({"type": "snapkv", "compression_ratio": 0.5, "window_size": 5, "kernel_size": 3}, 5),
    "pyramidkv": ({"type": "pyramidkv", "compression_ratio": 0.5, "window_size": 5, "kernel_size": 3}, 5),
    "tova": ({"type": "tova", "budget": 9, "schedule": "prefill"}, 1),
}


def _prefill(config: dict, seed: int) -> tuple[torch.Tensor, int]:
    """Kept positions after one prompt block, and how many weight rows the layer held until the block ended."""
    g = torch.Generator().manual_seed(seed)
    native = [NativeLayer("full", dict(num_kv_heads=H, head_dim=D, dtype=torch.float32))]
    cache = Cache.build(native, B, {"attention": {**config, "schedule": config.get("schedule", "prefill")}})
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    cache.begin_block(valid, T)
    layer = cache[0]
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    view = layer.update(k, v)
    assert layer.wants_attention_weights
    logits = torch.randn(B, HQ, T, view.keys.shape[2], generator=g)
    mask = view.mask[:, None] if view.mask.dim() == 3 else view.mask.repeat_interleave(HQ // H, 1)
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)  # [B, Hq, T, S]
    layer.observe_attention(weights)
    held = layer._observed[0].shape[2]
    cache.end_block()
    return layer.key_positions().clone(), held


@pytest.mark.parametrize("method", list(CONFIGS))
def test_only_the_read_rows_are_held_and_the_kept_positions_are_unchanged(method, monkeypatch):
    config, rows = CONFIGS[method]
    kept, held = _prefill(config, seed=1)
    assert held == rows
    scorer = get_layer_class(method).scorer_cls
    monkeypatch.setattr(scorer, "query_rows", lambda self: None)  # the full weights, as before
    full, held_all = _prefill(config, seed=1)
    assert held_all == T
    assert torch.equal(kept, full)
    assert bool((kept < 0).any() or kept.shape[-1] < T)  # something was evicted: a wrong row would show

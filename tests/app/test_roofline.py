"""The benchmark's roofline arithmetic against hand counts (no timing assertions)."""

import torch
from torch import nn

from experiments.roofline import read_bandwidth, roofline_row, weight_read_bytes


class Toy(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40 floats
        self.proj = nn.Linear(4, 4)  # 16 + 4 floats
        self.head = nn.Linear(4, 10, bias=False)  # 40 floats
        if tied:
            self.head.weight = self.embed.weight


def test_weight_bytes_count_a_tied_head_once_and_skip_untied_embeddings():
    assert weight_read_bytes(Toy(tied=True)) == {"weights": (40 + 20) * 4, "untied_embeddings_not_read": 0}
    assert weight_read_bytes(Toy(tied=False)) == {"weights": (20 + 40) * 4, "untied_embeddings_not_read": 40 * 4}
    half = Toy(tied=True).to(torch.bfloat16)
    assert weight_read_bytes(half)["weights"] == (40 + 20) * 2


def test_roofline_row():
    row = roofline_row("ours", 8, 40.0, weights=1000, cache_bytes=600, bandwidth=1e5)
    assert row["bytes_per_token"] == 200.0
    assert row["roofline_tok_s"] == 8 * 1e5 / 1600
    assert row["fraction"] == 40.0 / 500.0


def test_read_bandwidth_is_positive_and_finite():
    bw = read_bandwidth(8 << 20, repeats=3)
    assert 0 < bw < float("inf")

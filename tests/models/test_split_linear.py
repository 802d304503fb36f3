"""The batched-blocks CPU path for big projections: same results as F.linear (float64 to rounding), same
parameters (tied ones stay tied), only where it is meant to apply."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridcache as hc
from hybridcache.blocks.split_linear import SplitRowsLinear, split_linear, use_split_rows
from tests.models.conftest import prompts


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_linear_equals_linear(splits, lead, bias):
    g = torch.Generator().manual_seed(splits)
    w = torch.randn(48, 7, generator=g, dtype=torch.float64)
    b = torch.randn(48, generator=g, dtype=torch.float64) if bias else None
    x = torch.randn(*lead, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(split_linear(x, w, b, splits), F.linear(x, w, b), rtol=1e-13, atol=1e-13)


def test_use_split_rows_switches_only_big_divisible_linears_and_keeps_ties():
    model = nn.Module()
    model.embed = nn.Embedding(64, 8)
    model.head = nn.Linear(8, 64, bias=False)
    model.head.weight = model.embed.weight
    model.small = nn.Linear(8, 8)
    model.odd = nn.Linear(8, 63)  # no split divides 63 rows
    switched = use_split_rows(model, min_bytes=64 * 8 * 4)
    assert switched == ["head"] and type(model.head) is SplitRowsLinear and model.head.splits == 4
    assert model.head.weight is model.embed.weight and type(model.small) is nn.Linear and type(model.odd) is nn.Linear
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight), rtol=1e-5, atol=1e-5)
    many = torch.randn(100, 8)  # more rows than MAX_ROWS: the plain path
    assert torch.equal(model.head(many), F.linear(many, model.embed.weight))


def test_a_model_with_split_heads_generates_the_same(checkpoints):
    path = checkpoints("gemma3")
    plain = hc.from_pretrained(path, dtype=torch.float64, split_rows=False)
    split = hc.from_pretrained(path, dtype=torch.float64, split_rows=False)
    assert use_split_rows(split, min_bytes=0)  # every divisible projection, to exercise the path in a whole model
    ids = prompts(2, 13, seed=3)
    a = hc.generate(plain, ids, max_new_tokens=8)
    b = hc.generate(split, ids, max_new_tokens=8)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-12, atol=1e-12)

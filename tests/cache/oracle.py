"""Independent oracles for the cache tests: hand-written masks and naive attention over the whole sequence."""

import math

import torch


def allowed(pattern: str, param: int, q: int, kv: int) -> bool:
    """The attention patterns written out by hand, for positions q and kv of one row (both real tokens)."""
    if kv > q:
        return False
    if pattern == "full":
        return True
    if pattern == "sliding":
        return q - param < kv
    if pattern == "chunked":
        return kv // param == q // param
    raise ValueError(pattern)


def row_positions(pads: list[int], n: int) -> list[list[int]]:
    """Positions of a left-padded batch: row b has pads[b] padding columns (-1) then 0, 1, 2, ..."""
    return [[c - p if c >= p else -1 for c in range(n)] for p in pads]


def naive_attention(q, k, v, pads, pattern, param):
    """Whole-sequence attention [B, H, N, D] with the pattern's mask built token by token (float64)."""
    b, _, n, d = q.shape
    pos = row_positions(pads, n)
    mask = torch.zeros(b, n, n, dtype=torch.bool)
    for r in range(b):
        for i in range(n):
            for j in range(n):
                mask[r, i, j] = pos[r][i] >= 0 and pos[r][j] >= 0 and allowed(pattern, param, pos[r][i], pos[r][j])
    return masked_attention(q.double(), k.double(), v.double(), mask), mask


def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v over visible keys; rows without visible keys give zeros."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v

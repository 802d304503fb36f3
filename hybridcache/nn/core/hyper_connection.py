"""Manifold-constrained hyper-connections (mHC; GLM-5-Next, DeepSeek-V4 lineage): N residual streams instead of one.

Before a branch (attention or MLP) a one-layer perceptron on the RMS-normalised, flattened streams gives three
weights: `pre` [N] collapses the streams into the branch input, `post` [N] spreads the branch output back over
the streams, and `comb` [N, N] (made doubly stochastic by Sinkhorn iterations) mixes the input streams into the
output ones: out = post * branch(sum_n pre_n x_n) + comb^T @ x. HF's names per decoder layer: `fn`
[(2 + N) * N, N * D], `base` [(2 + N) * N] and `scale` [3] (saved as hc_attn_* / hc_ffn_*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HyperConnection(nn.Module):
    """forward(streams [B, T, N, D]) -> (post [B, T, N], comb [B, T, N, N], branch input [B, T, D])."""

    def __init__(self, hidden: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        n = streams
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, acc = self.n, torch.promote_types(x.dtype, torch.float32)
        flat = x.flatten(2).to(acc)  # [B, T, N * D]
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.to(acc)).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(acc).split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.to(acc).unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)  # Sinkhorn: columns, then rows and columns in turn
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(2).to(x.dtype)


def hyper_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The branch output out [B, T, D] spread by post [B, T, N], plus the streams [B, T, N, D] mixed by comb."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)

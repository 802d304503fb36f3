"""Per-layer input embeddings (PLE; Gemma 3n, Gemma 4): besides the residual stream, every decoder layer gets a
small vector of its own per token, and adds a gated projection of it to its output.

`PerLayerEmbeddings` (HF: the inner model's `embed_tokens_per_layer`, `per_layer_model_projection`,
`per_layer_projection_norm`) computes all layers' vectors at once: a token table (scaled by sqrt(width)) plus a
normalised projection of the scaled token embeddings (times 1/sqrt(hidden)), the sum times 1/sqrt(2).
`PerLayerInput` (HF: a layer's `per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm`) adds
norm(projection(act(gate(h)) * x)) to h.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import activation
from hybridcache.nn.core.norms import RMSNorm


class PerLayerEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, width: int, eps: float) -> None:
        super().__init__()
        self.layers, self.width, self.hidden = layers, width, hidden
        self.embed_tokens_per_layer = nn.Embedding(vocab, layers * width)
        self.per_layer_model_projection = nn.Linear(hidden, layers * width, bias=False)
        self.per_layer_projection_norm = RMSNorm(width, eps, scale_in_float32=True)

    def forward(self, ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """ids [B, T] and their scaled embeddings [B, T, D] -> every layer's input [B, T, L, P]."""
        shape = (*ids.shape, self.layers, self.width)
        tok = self.embed_tokens_per_layer(ids)
        tok = tok * torch.tensor(self.width**0.5, dtype=tok.dtype)
        proj = self.per_layer_model_projection(embeddings) * self.hidden**-0.5
        return (self.per_layer_projection_norm(proj.view(shape)) + tok.view(shape)) * 2**-0.5


class PerLayerInput(nn.Module):
    def __init__(self, hidden: int, width: int, act: str, eps: float) -> None:
        super().__init__()
        self.act = activation(act)
        self.per_layer_input_gate = nn.Linear(hidden, width, bias=False)
        self.per_layer_projection = nn.Linear(width, hidden, bias=False)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps, scale_in_float32=True)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # h [B, T, D], x [B, T, P]
        gated = self.act(self.per_layer_input_gate(h)) * x
        return h + self.post_per_layer_input_norm(self.per_layer_projection(gated))

"""A decoder layer of the pre-norm shape most hybrids use: a mixer (attention or a recurrent mixer) and optionally a
gated MLP, each branch after its own norm and added to the residual stream.

    h1 = h + mixer(input_norm(h))        out = h1 + mlp(mlp_norm(h1))    (no MLP branch: out = h1)

A family's layer keeps its own `forward` (the reference) and names its modules by role (`pre_norm_parts()`); the
CPU fast path runs consecutive such layers of a decode step in one C call (hybridcache.accel installs it as
`accel`, which `forward` does not call: only a many-layer step reads it).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


class PreNormParts(NamedTuple):
    """The modules of a pre-norm layer by role (mlp_norm and mlp None: no MLP branch)."""

    input_norm: nn.Module
    mixer: nn.Module  # forward(x, layer, step): an AttentionMixer or a recurrent mixer
    mlp_norm: nn.Module | None
    mlp: nn.Module | None


class PreNormLayer(nn.Module):
    """Base of a pre-norm decoder layer: a subclass builds the modules, runs them in `forward` and says which is
    which (`pre_norm_parts`; None: this layer is not of the shape, e.g. a MoE or scaled branch)."""

    def pre_norm_parts(self) -> PreNormParts | None:
        raise NotImplementedError

"""The fast path of a decoder layer whose only branch is an ungated MLP, h + down(act(up(norm(h)))) (Nemotron-H's MLP
blocks), as a record of a decode step's one C call over many layers (layer_records.py): hc_pre_norm_mlp
(csrc/layer_program.c), the same kernels in the same order as the module calls, so the same bits.

The layer names its parts: `layer.mlp_layer_parts()` -> (norm, the MLP module, up, down, the activation's name) or
None (not this shape). What the record does not take (hooks inside the layer, a norm or projection of another kind,
an activation hc_pre_norm_mlp does not compute, a prefill) declines: the layer runs as its module call.
"""

from __future__ import annotations

import torch

from hybridcache.accel.layers.pre_norm import PreNormAccel, _hooked
from hybridcache.accel.mixers.recurrent import _projection
from hybridcache.accel.native.layer_program import CODES, bind_mlp_layer, pre_norm_mlp_args, record_types
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import kernel_args, kernel_plain

_F32 = torch.float32


class MLPLayerAccel(PreNormAccel):
    """`layer.accel`: `binding` and `record` as layer_records.py asks (a pre-norm layer with no mixer: its record is
    one program op, and there is no slot to reserve, so `separate` is never asked)."""

    def binding(self, x: torch.Tensor, cache_layer):
        """("mlp", bind_mlp_layer's binding) for inputs like x [B, 1, D]; None where the kernels do not take it."""
        parts = self.layer.mlp_layer_parts()
        if parts is None or x.dtype is not _F32 or x.dim() != 3 or record_types() is None:
            return None
        norm, mlp, up, down, act = parts
        if norm is None or not kernel_plain(norm) or _hooked(norm, mlp):
            return None
        up, down = _projection(up), _projection(down)
        if up is None or down is None:
            return None
        bound = bind_mlp_layer(x.shape[2], kernel_args(norm), up, down, act)
        return None if bound is None else ("mlp", bound)

    def record(self, x: torch.Tensor, y: torch.Tensor, cache_layer, step: StepInput, binding=None):
        """This layer's eager decode step as one record: ([(op code, C arguments)], the tensors they point into,
        None: no states), or None (nothing done: run the module)."""
        bound = self.binding(x, cache_layer) if binding is None else binding
        if bound is None:
            return None
        got = pre_norm_mlp_args(x, y, bound[1])
        if got is None:
            return None
        args, scratch = got
        return [(CODES["pre_norm_mlp"], args)], (x, y, scratch), None

    def separate(self, h: torch.Tensor, cache_layer, step: StepInput, reserved):
        raise RuntimeError("an MLP layer reserves no slot: its record never asks for the separate path")

    def rotary(self):
        return None

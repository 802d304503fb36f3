"""What a greedy C loop computes besides the layers (decode_run.py's hc_decode_steps, program_run.py's
hc_program_steps): the model's embedding and head as forms the loop evaluates, and the report of a step whose chosen
logit is not finite."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.native.checks import _real, _vec
from hybridcache.accel.native.fused import _matrix
from hybridcache.accel.native.op_declarations import WEIGHT_TYPES
from hybridcache.nn.core.linear import DecodeLinear, PackedEmbedding
from hybridcache.nn.core.norms import RMSNorm

_F32 = torch.float32


class NonFiniteLogits(ArithmeticError):
    """A greedy run's step whose chosen logit is not finite (hc_decode_steps -3): the tokens [n] and logits chosen
    before it, which the caller hands on before it reports the step, and that step's row of logits `row` [V]."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor, row: torch.Tensor) -> None:
        super().__init__(f"the logits after {tokens.shape[0]} greedy steps are not finite")
        self.tokens, self.logits, self.row = tokens, logits, row


def greedy_forms(model: nn.Module) -> tuple[tuple, tuple] | None:
    """(the embedding's form and multiplier, the head's form) for the greedy loop, from the model's
    `embed_head_parts()` (embedding module, multiplier, final norm, lm_head); None where the model has none or they
    are not forms the loop computes."""
    parts_of = getattr(model, "embed_head_parts", None)
    parts = None if parts_of is None else parts_of()
    if parts is None:
        return None
    embedding, multiplier, norm, lm_head = parts
    e, h = embedding_form(embedding), head_form(norm, lm_head)
    return None if e is None or h is None else ((*e, multiplier), h)


def embedding_form(e: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(table [V, D], scale [V] (int8) / [V, D / 32] (q8_0) or None) where e(ids) is the table's rows widened to
    float32 (times their scale): a plain float32 nn.Embedding, or a PackedEmbedding to float32. None otherwise."""
    w = getattr(e, "weight", None)
    if type(e) is nn.Embedding:
        ok, scale = w.dtype == _F32, None
    elif type(e) is PackedEmbedding:
        ok, scale = e.out_dtype == _F32 and w.dtype in WEIGHT_TYPES, e._buffers.get("scale")
    else:
        return None
    if not ok or e.max_norm is not None or w.dim() != 2 or not w.is_cpu or not w.is_contiguous():
        return None
    return (w, scale) if _matrix(w, w.shape[0], w.shape[1], scale) is not None else None


def head_form(norm: nn.Module, linear: nn.Module):
    """(norm scale [D] and eps, weight [V, D], row scale [V] or None, bias [V] or None) where head(h) =
    linear(norm(h)) runs the RMSNorm kernel, then the decode_linear kernel. None otherwise."""
    if type(norm) is not RMSNorm or norm.weight.dtype != _F32 or not _real(norm.eps):
        return None
    if type(linear) is not DecodeLinear:
        return None
    w, scale, bias = linear.weight, linear._buffers.get("scale"), linear.bias
    if w.dtype not in WEIGHT_TYPES or w.dim() != 2 or not w.is_cpu or not w.is_contiguous():
        return None
    scale_n = norm.kernel_scale()
    if not (_vec(scale_n, w.shape[1]) and _vec(bias, w.shape[0])) or _matrix(w, *w.shape, scale) is None:
        return None
    return scale_n, float(norm.eps), w, scale, bias

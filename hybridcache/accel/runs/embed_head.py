"""What a greedy C loop computes besides the layers (decode_run.py's hc_decode_steps, program_run.py's
hc_program_steps): the model's embedding and head as forms the loop evaluates, and the report of a step whose chosen
logit is not finite."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from hybridcache.accel.native.checks import INT_MAX, _ptr, _real, _vec
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


def loop_arguments(who: str, model: nn.Module, first, k, eos, room: int, d: int, rows: int) -> tuple[tuple, int]:
    """The greedy loops' embedding and head arguments, in the C order (table, its type, its scale, vocabulary,
    multiplier, norm scale, eps, head weight, its type, its scale, its bias, V), and V, for k steps of a run with
    `room` steps left, width d and `rows` rows, from token `first`, stopping at `eos`. NotImplementedError where the
    model's embedding or head is not a form the loop computes; ValueError (named by `who`) for arguments that do
    not fit."""
    forms = greedy_forms(model)
    if forms is None:
        raise NotImplementedError(f"{who}: the model's embedding or head is not one the loop computes")
    (table_w, table_rs, multiplier), (norm, eps, w_head, head_rs, head_bias) = forms
    vocab, v = table_w.shape[0], w_head.shape[0]
    if (
        type(k) is not int
        or type(first) is not int
        or not 0 < k <= room
        or not all(type(e) is int and 0 <= e < 2**63 for e in eos)
        or rows != 1
        or table_w.shape[1] != d
        or w_head.shape[1] != d
        or not 0 <= first < vocab
        or v > INT_MAX
        or k * v > 2**62
        or vocab > 2**62
        or (norm is not None and not _vec(norm, d))
        or not _vec(head_bias, v)
        or _matrix(table_w, vocab, d, table_rs) is None
        or _matrix(w_head, v, d, head_rs) is None
    ):
        raise ValueError(
            f"{who}: {k!r} steps from token {first!r} (eos {eos!r}) do not fit this run ({room} steps left) or model "
            f"(vocabulary {vocab})"
        )
    table_t, head_t = _matrix(table_w, vocab, d, table_rs), _matrix(w_head, v, d, head_rs)
    head = (_ptr(norm), eps, w_head.data_ptr(), head_t, _ptr(head_rs), _ptr(head_bias), v)
    return (table_w.data_ptr(), table_t, _ptr(table_rs), vocab, multiplier, *head), v


def rope_rows(who: str, layers, positions: torch.Tensor) -> tuple:
    """The rotary tables of k steps for the greedy loops: `layers` (record, its rotary or None) in the loop's order,
    positions [k]. Returns (rope index per layer (-1: none) as a C int array, cos and sin table pointers as C
    arrays, the tables [k, R] they point into: keep them alive), each position's tables as a step computes them."""
    ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    index = []
    for rec, rotary in layers:
        if rotary is None:
            index.append(-1)
            continue
        if id(rotary) not in ropes:  # row by row, as a step computes them
            rows = [rotary.tables(p.view(1, 1), _F32) for p in positions]  # [1, 1, 1, R] each
            ropes[id(rotary)] = tuple(torch.cat([t[i].reshape(1, -1) for t in rows]) for i in (0, 1))
        if ropes[id(rotary)][0].shape[1] != rec.rot:
            raise ValueError(f"{who}: a layer's rotary tables changed width")
        index.append(list(ropes).index(id(rotary)))
    cos = (ctypes.c_void_p * max(len(ropes), 1))(*(c.data_ptr() for c, _ in ropes.values()))
    sin = (ctypes.c_void_p * max(len(ropes), 1))(*(s.data_ptr() for _, s in ropes.values()))
    return (ctypes.c_int * max(len(index), 1))(*index), cos, sin, list(ropes.values())


def loop_result(run, fn: str, n: int, ran: int, first: int, tokens: torch.Tensor, logits: torch.Tensor, keep: bool):
    """After a greedy loop's call `fn` that returned n and ran `ran` steps from the run's step run.steps: the run's
    fed tokens and step count moved on, then (tokens [n], logits) or the loop's failure raised (NonFiniteLogits,
    MemoryError, ValueError)."""
    j = run.steps
    run.ids[0, j] = first
    run.ids[0, j + 1 : j + ran] = tokens[: max(ran - 1, 0)]  # (none when the first step failed)
    run.steps = j + ran
    if n == -3:
        raise NonFiniteLogits(tokens[:ran], logits[:ran] if keep else logits, logits[ran] if keep else logits[0])
    if n < 0:
        raise (
            MemoryError(f"{fn}: a layer found no memory for its scratch")
            if n == -1
            else ValueError(f"{fn}: a token outside the embedding")
        )
    return tokens[:n], logits[:n] if keep else logits

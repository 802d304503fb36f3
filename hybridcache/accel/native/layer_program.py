"""A decode step's pre-norm layers in one C call (csrc/layer_program.c, hc_layer_program): a program of records, each
one kernel call's arguments (a whole attention layer's hc_decoder_layer, or a recurrent layer's input norm, one-call
mixer step and tail), run in order with no interpreter between them.

Every record is built from arguments the call's own checked wrapper built (decoder_layer.py `run.record`,
native/steps/recurrent.py `*_args`, `pre_norm_tail_args` here): nothing reaches C unchecked. The records' layouts
are the library's (`hc_op_record_codes / _names / _size` per op): each must be its function's declared signature
(op_declarations.SIGNATURES) and ctypes' size of it, or nothing here runs.
"""

from __future__ import annotations

import ctypes

import torch

from hybridcache.accel.native.checks import INT_MAX, MAX_ROWS, _ptr, _real, _vec
from hybridcache.accel.native.fused import _matrix, _mlp_args
from hybridcache.accel.native.library import _library
from hybridcache.accel.native.op_declarations import _F, _I, _L, _P, ACT_MUL, SIGNATURES

# hc_layer_program's op codes, in csrc/layer_program.c's order -> the C function each record calls
OPS = {
    "decoder_layer": "hc_decoder_layer",
    "rms_norm": "hc_rms_norm",
    "short_conv": "hc_short_conv_step",
    "mamba2": "hc_mamba2_step",
    "mamba": "hc_mamba_step",
    "gated_delta": "hc_gated_delta_step",
    "pre_norm_tail": "hc_pre_norm_tail",
    "delta": "hc_delta_step",
    "rglru": "hc_rglru_step",
    "mamba_groups": "hc_mamba_groups_step",
    "pre_norm_mlp": "hc_pre_norm_mlp",
    "sandwich_tail": "hc_sandwich_tail",
    "attention_layer": "hc_attention_layer",
    "gated_decoder_layer": "hc_gated_decoder_layer",
}
MLP_ACTS = {"relu2": 0}  # the ungated MLP activations hc_pre_norm_mlp computes -> its code
CODES = {name: i for i, name in enumerate(OPS)}
_LETTERS = {_P: "P", _I: "I", _L: "L", _F: "F"}
_F32 = torch.float32
_state: dict = {}  # "lib": id of the library checked, "types": op code -> its record's ctypes type (None: mismatch)


class ProgramError(RuntimeError):
    """hc_layer_program: a record no layer could run (no library, or its record layouts are not the declared ones)."""


def record_types() -> dict[int, type[ctypes.Structure]] | None:
    """Op code -> the ctypes Structure of its record, or None (no library, or a layout that is not the declared one:
    then no program runs)."""
    lib = _library()
    if lib is None:
        return None
    if _state.get("lib") != id(lib):
        types: dict[int, type[ctypes.Structure]] | None = {}
        if lib.hc_op_count() != len(OPS):
            types = None
        for code, fn in enumerate(OPS.values()):
            if types is None:
                break
            declared = SIGNATURES[fn][1]
            names = lib.hc_op_record_names(code).decode().split(",")
            if len(names) != len(declared) or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
                types = None
                break
            record = type(f"Record_{fn}", (ctypes.Structure,), {"_fields_": list(zip(names, declared, strict=True))})
            want = "".join(_LETTERS[t] for t in declared).encode()
            if lib.hc_op_record_codes(code) != want or lib.hc_op_record_size(code) != ctypes.sizeof(record):
                types = None
                break
            types[code] = record
        _state.update(lib=id(lib), types=types)
    return _state["types"]


def call_program(program: list[tuple[int, tuple | ctypes.Structure]]) -> None:
    """Run each (op code, that op's checked C arguments, or its record built from them) in order by one call.
    Raises MemoryError naming the record whose attention found no memory for its scratch (the records before it
    ran)."""
    types = record_types()
    if types is None:
        raise ProgramError("hc_layer_program: the library's record layouts are not the declared ones")
    if not all(type(op) is int and op in types for op, _ in program):
        raise ProgramError(f"hc_layer_program: an op code outside {sorted(types)}")
    records = [types[op](*args) if type(args) is tuple else args for op, args in program]
    if not all(type(r) is types[op] for (op, _), r in zip(program, records, strict=True)):
        raise ProgramError("hc_layer_program: a record of another op's or library's layout")
    ops = (ctypes.c_int * len(program))(*(op for op, _ in program))
    pointers = (ctypes.c_void_p * len(program))(*(ctypes.addressof(r) for r in records))
    failed = ctypes.c_int(-1)
    err = _library().hc_layer_program(ops, pointers, len(program), ctypes.addressof(failed))
    if err:
        raise MemoryError(f"hc_layer_program: record {failed.value} failed ({err}): no memory for attention scratch")


def rms_norm_args(x: torch.Tensor, scale: torch.Tensor, eps: float, out: torch.Tensor) -> tuple | None:
    """hc_rms_norm's arguments for x [B, 1, D] -> out (both contiguous float32 [B, 1, D], B <= MAX_ROWS), by the
    effective scale [D] and eps (checked by the caller's binding); None where they do not fit."""
    if not (_rows_ok(x) and _rows_ok(out) and out.shape == x.shape and scale is not None and _vec(scale, x.shape[2])):
        return None
    if not _real(eps):
        return None
    return x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.shape[0], x.shape[2], float(eps)


def _rows_ok(t: torch.Tensor) -> bool:
    return (
        t.dtype is _F32
        and t.is_cpu
        and t.dim() == 3
        and t.shape[1] == 1
        and 0 < t.shape[0] <= MAX_ROWS
        and t.is_contiguous()
        and t.numel() <= INT_MAX
    )


def bind_tail(d: int, norm: tuple[torch.Tensor, float] | None, gate_up: tuple | None, down: tuple | None, act: str):
    """The static part of hc_pre_norm_tail's arguments for a residual of width d: the MLP's norm (scale [d], eps;
    None: none), its fused gate / up (weight [2I, d], bias, scale) and down (weight [d, I], bias, scale) and
    activation (gate_up None: no MLP branch, out = h + y). Returns (static arguments, scratch floats per row) or
    None where the kernels do not take them."""
    if gate_up is None:
        return (None, 0.0, 0, None, 0, None, None, None, 0, None, None, 0), 0
    code = ACT_MUL.get(act) if isinstance(act, str) else None
    w_gu, w_dn = gate_up[0], down[0]
    if code is None or not isinstance(w_gu, torch.Tensor) or w_gu.dim() != 2 or w_gu.shape[0] % 2:
        return None
    i = w_gu.shape[0] // 2
    t_gu, t_dn = _matrix(w_gu, 2 * i, d, gate_up[2]), _matrix(w_dn, d, i, down[2])
    n_scale, eps = norm if norm is not None else (None, 0.0)
    if (
        t_gu is None
        or t_dn is None
        or not _vec(gate_up[1], 2 * i)
        or not _vec(down[1], d)
        or (norm is not None and (n_scale is None or not _vec(n_scale, d)))
        or (3 * d + 3 * i) * MAX_ROWS > INT_MAX
    ):
        return None
    return (_ptr(n_scale), float(eps), i, *_mlp_args(gate_up, t_gu, down, t_dn, code)), 3 * d + 3 * i


def pre_norm_tail_args(h: torch.Tensor, y: torch.Tensor, out: torch.Tensor, bound: tuple) -> tuple | None:
    """hc_pre_norm_tail's arguments: h, y, out [B, 1, D] (contiguous float32) and `bound_tail`'s binding; returns
    (arguments, the scratch they point into) or None."""
    static, per_row = bound
    if not (_rows_ok(h) and _rows_ok(y) and _rows_ok(out) and h.shape == y.shape == out.shape):
        return None
    b, d = h.shape[0], h.shape[2]
    scratch = torch.empty(max(b * per_row, 1), dtype=_F32)
    return (h.data_ptr(), y.data_ptr(), b, d, *static, scratch.data_ptr(), out.data_ptr()), scratch


def bind_mlp_layer(d: int, norm: tuple[torch.Tensor, float], up: tuple, down: tuple, act: str):
    """The static part of hc_pre_norm_mlp's arguments for a residual of width d: the norm's (scale [d], eps), the up
    (weight [I, d], bias, scale) and down (weight [d, I], bias, scale) projections and the activation (MLP_ACTS).
    Returns (d, static arguments, scratch floats per row) or None where the kernels do not take them."""
    code = MLP_ACTS.get(act) if isinstance(act, str) else None
    w_up, w_dn = up[0], down[0]
    if code is None or not isinstance(w_up, torch.Tensor) or w_up.dim() != 2 or type(d) is not int:
        return None
    i = w_up.shape[0]
    t_up, t_dn = _matrix(w_up, i, d, up[2]), _matrix(w_dn, d, i, down[2])
    scale, eps = norm
    if (
        t_up is None
        or t_dn is None
        or not _vec(up[1], i)
        or not _vec(down[1], d)
        or scale is None
        or not _vec(scale, d)
        or not _real(eps)
        or not 0 < (2 * d + 2 * i) * MAX_ROWS <= INT_MAX
    ):
        return None
    static = (scale.data_ptr(), float(eps), i, w_up.data_ptr(), t_up, _ptr(up[2]), _ptr(up[1]))
    return d, static + (w_dn.data_ptr(), t_dn, _ptr(down[2]), _ptr(down[1]), code), 2 * d + 2 * i


def pre_norm_mlp_args(h: torch.Tensor, out: torch.Tensor, bound: tuple) -> tuple | None:
    """hc_pre_norm_mlp's arguments: h, out [B, 1, D] (contiguous float32) and `bind_mlp_layer`'s binding; returns
    (arguments, the scratch they point into) or None."""
    d, static, per_row = bound
    if not (_rows_ok(h) and _rows_ok(out) and h.shape == out.shape and h.shape[2] == d):
        return None
    b = h.shape[0]
    scratch = torch.empty(b * per_row, dtype=_F32)
    return (h.data_ptr(), b, d, *static, scratch.data_ptr(), out.data_ptr()), scratch


def bind_sandwich_tail(d: int, post: tuple | None, mid: tuple, post_mlp: tuple | None):
    """hc_sandwich_tail's static arguments: a post norm's (scale [d], eps) after the mixer and after the MLP (None:
    none) around `bind_tail`'s binding of the MLP branch (with its norm); None where the kernels do not take them."""
    static, per_row = mid
    if static[3] is None or any(
        n is not None and not (_vec(n[0], d) and n[0] is not None and _real(n[1])) for n in (post, post_mlp)
    ):
        return None
    (p, p_eps), (q, q_eps) = post or (None, 0.0), post_mlp or (None, 0.0)
    return (_ptr(p), float(p_eps), *static, _ptr(q), float(q_eps)), per_row


def sandwich_tail_args(h: torch.Tensor, y: torch.Tensor, out: torch.Tensor, bound: tuple) -> tuple | None:
    """hc_sandwich_tail's arguments: h, y, out [B, 1, D] (contiguous float32) and `bind_sandwich_tail`'s binding;
    returns (arguments, the scratch they point into) or None."""
    static, per_row = bound
    if not (_rows_ok(h) and _rows_ok(y) and _rows_ok(out) and h.shape == y.shape == out.shape):
        return None
    b, d = h.shape[0], h.shape[2]
    scratch = torch.empty(b * per_row, dtype=_F32)
    return (h.data_ptr(), y.data_ptr(), b, d, *static, scratch.data_ptr(), out.data_ptr()), scratch

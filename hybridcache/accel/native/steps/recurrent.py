"""A recurrent mixer's one-token decode step as one C call (csrc/recurrent_step.c): LFM2's short convolution, the
Mamba2 and Mamba1 mixers, Gated DeltaNet and its variants, RG-LRU, projections included. The states are read from the
given tensors and the new ones returned as fresh tensors (the caller hands them to the cache). `*_args` (and
`Mamba2Step.args`) check and return (the C call's arguments, its outputs (y, the new states), the tensors the
arguments point into); `*_step` runs it, a decode step's layer program (layer_program.py) with the step's other
layers. Each returns None (the caller's reference path) for what its kernel does not take (not float32 CPU eager,
no kernels built, a weight format it does not read) and raises KernelArgumentError for sizes that do not fit
together, before any C call.
"""

from __future__ import annotations

import ctypes
import math

import torch

from hybridcache.accel.native.checks import INT_MAX, MAX_ROWS, KernelArgumentError, _eager, _ptr, _real, _vec
from hybridcache.accel.native.fused import _matrix
from hybridcache.accel.native.library import _library

_F32 = torch.float32
GATES = {"silu": 0, "norm_after_gate": 1, "norm_before_gate": 2}  # hc_mamba2_step's `norm` codes


def _state(t: torch.Tensor, shape: tuple, what: str) -> bool:
    """Whether `t` is a contiguous float32 CPU state of `shape` (False: not taken); wrong sizes raise."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{what} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise KernelArgumentError(f"{what} must be {list(shape)}, got {list(t.shape)}")
    return t.dtype == _F32 and t.is_cpu and t.layout == torch.strided and t.is_contiguous()


def _proj(parts: tuple, rows: int, cols: int, what: str) -> int | None:
    """The type code of a projection (weight [rows, cols], bias, scale) the kernels read; None: not taken."""
    w, bias, scale = parts
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise KernelArgumentError(f"{what} weight must be a matrix, got {type(w).__name__}")
    if tuple(w.shape) != (rows, cols):
        raise KernelArgumentError(f"{what} weight must be [{rows}, {cols}], got {list(w.shape)}")
    code = _matrix(w, rows, cols, scale)  # (float32, bfloat16, int8 with a row scale, q8_0 with its block scales)
    return code if code is not None and _vec(bias, rows) else None


def _rows(x: torch.Tensor, width: int) -> int | None:
    """B of x [B, 1, width] (a decode step of at most MAX_ROWS rows), None where it is not one."""
    if not _eager(x) or x.dim() != 3 or x.shape[1] != 1:
        return None
    if x.shape[2] != width:
        raise KernelArgumentError(f"the input must have {width} features, got {x.shape[2]}")
    return x.shape[0] if 0 < x.shape[0] <= MAX_ROWS else None


def short_conv_args(
    x: torch.Tensor,
    in_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    state: torch.Tensor,
    out_proj: tuple,
) -> tuple[tuple, tuple, tuple] | None:
    """LFM2 ShortConv of one token: x [B, 1, D], in_proj / out_proj (weight, bias, scale) [3D, D] / [D, D], the conv
    weight [D, K] and bias [D], the state [B, D, K-1] -> (y [B, 1, D], the new state [B, D, K-1])."""
    lib = _library()
    if lib is None or not isinstance(x, torch.Tensor) or not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2:
        return None
    d, k = conv_w.shape
    if not 2 <= k <= 64 or not 0 < 5 * d * MAX_ROWS <= INT_MAX:
        raise KernelArgumentError(f"short conv: width {k} outside [2, 64] or {d} channels too many")
    b = _rows(x, d)
    if b is None:
        return None
    t_in, t_out = _proj(in_proj, 3 * d, d, "in_proj"), _proj(out_proj, d, d, "out_proj")
    if not (_state(state, (b, d, k - 1), "the conv state") and _vec(conv_w.reshape(-1), d * k)):
        return None
    if t_in is None or t_out is None or not conv_w.is_contiguous() or not _vec(conv_b, d):
        return None
    x = x.contiguous()
    new_state, y = torch.empty(state.shape, dtype=_F32), torch.empty(x.shape, dtype=_F32)
    scratch = torch.empty(b * 5 * d, dtype=_F32)
    (w_in, b_in, s_in), (w_out, b_out, s_out) = in_proj, out_proj
    args = (
        x.data_ptr(), b, d, k, w_in.data_ptr(), t_in, _ptr(s_in), _ptr(b_in), conv_w.data_ptr(), _ptr(conv_b),
        state.data_ptr(), new_state.data_ptr(), w_out.data_ptr(), t_out, _ptr(s_out), _ptr(b_out),
        scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return args, (y, new_state), (x, scratch)


class Mamba2Step:
    """hc_mamba2_step with its weights checked once (bind_mamba2_step): `run(x, conv_state, ssm_state)` checks only
    those and calls the kernel. Holds the weight tensors it points at."""

    def __init__(self, lib, sizes: tuple, head: tuple, tail: tuple, keep: tuple) -> None:
        self.lib, self.sizes, self.head, self.tail, self.keep = lib, sizes, head, tail, keep

    def args(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> tuple | None:
        """x [B, 1, Dm], conv_state [B, I + 2GN, K-1], ssm_state [B, H, P, N] -> (hc_mamba2_step's arguments, its
        outputs (y [B, 1, Dm], the new conv state, the new ssm state), the tensors they point into); None where the
        kernel does not take them."""
        dm, h, p, n, k, cc, scratch_cols = self.sizes
        b = _rows(x, dm) if isinstance(x, torch.Tensor) else None
        if b is None:
            return None
        states_ok = _state(conv_state, (b, cc, k - 1), "the conv state") and _state(
            ssm_state, (b, h, p, n), "the state"
        )
        if not states_ok:
            return None
        x = x.contiguous()
        new_conv, new_ssm = torch.empty(conv_state.shape, dtype=_F32), torch.empty(ssm_state.shape, dtype=_F32)
        y, scratch = torch.empty(x.shape, dtype=_F32), torch.empty(b * scratch_cols, dtype=_F32)
        args = (
            x.data_ptr(), b, dm, *self.head, conv_state.data_ptr(), new_conv.data_ptr(), *self.tail[:5],
            ssm_state.data_ptr(), new_ssm.data_ptr(), *self.tail[5:], scratch.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        return args, (y, new_conv, new_ssm), (x, scratch)

    def run(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`args`' call run: (y [B, 1, Dm], the new conv state, the new ssm state), or None (not taken)."""
        got = self.args(x, conv_state, ssm_state)
        if got is None:
            return None
        self.lib.hc_mamba2_step(*got[0])
        return got[1]


def bind_mamba2_step(
    dm: int,
    sizes: tuple[int, int, int, int],
    in_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    d_skip: torch.Tensor | None,
    dt_limit: tuple[float, float],
    gate: str,
    norm: tuple[torch.Tensor, float] | None,
    out_proj: tuple,
) -> Mamba2Step | None:
    """mamba2_step's weights for inputs of dm features, checked once -> a Mamba2Step, or None where the kernel does
    not take them."""
    lib = _library()
    if lib is None or not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2:
        return None
    if len(sizes) != 4 or not all(type(v) is int and v >= 1 for v in sizes):
        raise KernelArgumentError(f"mamba2 step: sizes must be 4 positive ints (H, P, G, N), got {sizes}")
    h, p, g, n = sizes
    i, gn = h * p, g * n
    cc, e = i + 2 * gn, 2 * i + 2 * gn + h
    k = conv_w.shape[1]
    if h % g or i % g or gate not in GATES or (gate == "silu") != (norm is None):
        raise KernelArgumentError(f"mamba2 step: {h} heads in {g} groups, gate {gate!r} with norm {norm is not None}")
    if conv_w.shape[0] != cc or not 2 <= k <= 64 or not 0 < (e + cc + i) * MAX_ROWS <= INT_MAX:
        raise KernelArgumentError(f"mamba2 step: conv weight {list(conv_w.shape)} for {cc} channels, width in [2, 64]")
    if not (len(dt_limit) == 2 and all(_real(v) and not math.isnan(v) for v in dt_limit)):
        raise KernelArgumentError(f"mamba2 step: dt_limit must be two real numbers, got {dt_limit}")
    t_in, t_out = _proj(in_proj, e, dm, "in_proj"), _proj(out_proj, dm, i, "out_proj")
    norm_w, eps = norm if norm is not None else (None, 0.0)
    if (
        t_in is None
        or t_out is None
        or not conv_w.is_contiguous()
        or not all(_vec(v, h) and v is not None for v in (dt_bias, a_log))
        or not all(_vec(v, n_) for v, n_ in ((d_skip, h), (conv_b, cc), (norm_w, i)))
        or not _real(eps)
    ):
        return None
    (w_in, b_in, s_in), (w_out, b_out, s_out) = in_proj, out_proj
    head = (h, p, g, n, k, w_in.data_ptr(), t_in, _ptr(s_in), _ptr(b_in), conv_w.data_ptr(), _ptr(conv_b))
    tail = (dt_bias.data_ptr(), a_log.data_ptr(), _ptr(d_skip), float(dt_limit[0]), float(dt_limit[1]), GATES[gate])
    tail += (_ptr(norm_w), float(eps), w_out.data_ptr(), t_out, _ptr(s_out), _ptr(b_out))
    keep = (in_proj, conv_w, conv_b, dt_bias, a_log, d_skip, norm, out_proj)
    return Mamba2Step(lib, (dm, h, p, n, k, cc, e + cc + i), head, tail, keep)


def mamba2_step(
    x: torch.Tensor,
    sizes: tuple[int, int, int, int],
    in_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    conv_state: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    d_skip: torch.Tensor | None,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    gate: str,
    norm: tuple[torch.Tensor, float] | None,
    out_proj: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The Mamba2 mixer on one token: x [B, 1, Dm], sizes (heads H, head_dim P, groups G, state_size N), in_proj
    (weight [2I + 2GN + H, Dm], bias, scale) with I = H P, the conv weight [I + 2GN, K] and bias, conv_state
    [B, I + 2GN, K-1], dt_bias / A_log / D [H], dt_limit (lo, hi), ssm_state [B, H, P, N], the gate (GATES), the
    gated norm's (weight [I], eps) (None for "silu"), out_proj (weight [Dm, I], bias, scale) -> (y [B, 1, Dm], the
    new conv state, the new ssm state). (bind_mamba2_step + Mamba2Step.run in one call.)"""
    if _library() is None or not isinstance(x, torch.Tensor):
        return None
    dm = x.shape[-1] if x.dim() else 0
    bound = bind_mamba2_step(dm, sizes, in_proj, conv_w, conv_b, dt_bias, a_log, d_skip, dt_limit, gate, norm, out_proj)
    return None if bound is None else bound.run(x, conv_state, ssm_state)


def mamba_args(
    x: torch.Tensor,
    in_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    conv_state: torch.Tensor,
    x_proj: tuple,
    inner_norms: tuple | None,
    dt_proj: tuple,
    a_log: torch.Tensor,
    d_skip: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out_proj: tuple,
) -> tuple[tuple, tuple, tuple] | None:
    """The Mamba1 mixer on one token: x [B, 1, Dm], in_proj (weight [2 Di, Dm], bias, scale), the conv weight
    [Di, K] and bias, conv_state [B, Di, K-1], x_proj (weight [R + 2N, Di], None, scale), the inner norms ((scale,
    eps) of dt [R], B [N], C [N]; None: none), dt_proj (weight [Di, R], bias [Di]: inside the softplus, scale),
    A_log [Di, N], D [Di], ssm_state [B, Di, N], out_proj (weight [Dm, Di], bias, scale) -> (y [B, 1, Dm], the new
    conv state, the new ssm state)."""
    lib = _library()
    if lib is None or not isinstance(x, torch.Tensor) or not isinstance(a_log, torch.Tensor) or a_log.dim() != 2:
        return None
    di, n = a_log.shape
    if not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2 or conv_w.shape[0] != di:
        raise KernelArgumentError(
            f"mamba step: the conv weight must be [{di}, K], got {getattr(conv_w, 'shape', None)}"
        )
    k = conv_w.shape[1]
    w_x = x_proj[0]
    if not isinstance(w_x, torch.Tensor) or w_x.dim() != 2 or not 2 * n < w_x.shape[0] <= 2 * n + di:
        raise KernelArgumentError(f"mamba step: x_proj must be [R + {2 * n}, {di}] with 1 <= R <= {di}")
    r = w_x.shape[0] - 2 * n
    if not 2 <= k <= 64 or not 0 < (8 * di + 4 * r + 4 * n) * MAX_ROWS + di * n <= INT_MAX:
        raise KernelArgumentError(f"mamba step: conv width {k} outside [2, 64], or sizes too large")
    if inner_norms is not None and (len(inner_norms) != 3 or any(len(v) != 2 for v in inner_norms)):
        raise KernelArgumentError("mamba step: inner_norms must be three (scale, eps) pairs or None")
    dm = x.shape[-1] if x.dim() else 0
    b = _rows(x, dm)
    if b is None:
        return None
    codes = (
        _proj(in_proj, 2 * di, dm, "in_proj"),
        _proj(x_proj, r + 2 * n, di, "x_proj"),
        _proj((dt_proj[0], None, dt_proj[2]), di, r, "dt_proj"),
        _proj(out_proj, dm, di, "out_proj"),
    )
    states_ok = _state(conv_state, (b, di, k - 1), "the conv state") and _state(ssm_state, (b, di, n), "the state")
    norms = inner_norms or ((None, 0.0),) * 3
    if (
        not states_ok
        or None in codes
        or x_proj[1] is not None
        or not conv_w.is_contiguous()
        or not (a_log.dtype == _F32 and a_log.is_cpu and a_log.is_contiguous())
        or not all(_vec(v, n_) for v, n_ in ((conv_b, di), (dt_proj[1], di), (d_skip, di)))
        or not all(_vec(s, w) and _real(e) for (s, e), w in zip(norms, (r, n, n), strict=True))
    ):
        return None
    x = x.contiguous()
    new_conv, new_ssm = torch.empty(conv_state.shape, dtype=_F32), torch.empty(ssm_state.shape, dtype=_F32)
    y = torch.empty(x.shape, dtype=_F32)
    scratch = torch.empty(b * (6 * di + 2 * (r + 2 * n)) + di * n, dtype=_F32)
    (w_in, b_in, s_in), (_, _, s_x), (w_dt, b_dt, s_dt), (w_out, b_out, s_out) = in_proj, x_proj, dt_proj, out_proj
    (dt_n, dt_e), (b_n, b_e), (c_n, c_e) = norms
    args = (
        x.data_ptr(), b, dm, di, n, k, r, w_in.data_ptr(), codes[0], _ptr(s_in), _ptr(b_in), conv_w.data_ptr(),
        _ptr(conv_b), conv_state.data_ptr(), new_conv.data_ptr(), w_x.data_ptr(), codes[1], _ptr(s_x), _ptr(dt_n),
        float(dt_e), _ptr(b_n), float(b_e), _ptr(c_n), float(c_e), w_dt.data_ptr(), codes[2], _ptr(s_dt), _ptr(b_dt),
        a_log.data_ptr(), _ptr(d_skip), ssm_state.data_ptr(), new_ssm.data_ptr(), w_out.data_ptr(), codes[3],
        _ptr(s_out), _ptr(b_out), scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return args, (y, new_conv, new_ssm), (x, scratch)


def gated_delta_args(
    x: torch.Tensor,
    heads: tuple[int, int, int, int],
    qkvz: tuple,
    ba: tuple,
    conv_w: torch.Tensor,
    conv_state: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    beta_scale: float,
    rec_state: torch.Tensor,
    norm: tuple[torch.Tensor, float],
    out_proj: tuple,
) -> tuple[tuple, tuple, tuple] | None:
    """Qwen3-Next's Gated DeltaNet mixer on one token: x [B, 1, Dm], heads (Hk, Hv, Dk, Dv), in_proj_qkvz / in_proj_ba
    (weight [2 Hk Dk + 2 Hv Dv, Dm] / [2 Hv, Dm], no bias, scale), the conv weight [2 Hk Dk + Hv Dv, K] (no bias),
    conv_state [B, that, K-1], dt_bias / A_log [Hv], beta's scale, rec_state [B, Hv, Dk, Dv], the gated head norm's
    (weight [Dv], eps), out_proj (weight [Dm, Hv Dv], no bias, scale) -> (y [B, 1, Dm], the new conv state, the new
    recurrent state)."""
    lib = _library()
    if lib is None or not isinstance(x, torch.Tensor) or not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2:
        return None
    if len(heads) != 4 or not all(type(v) is int and v >= 1 for v in heads) or heads[1] % heads[0]:
        raise KernelArgumentError(f"gated delta step: heads must be (Hk, Hv, Dk, Dv) >= 1 with Hk | Hv, got {heads}")
    hk, hv, dk, dv = heads
    cc, e1 = 2 * hk * dk + hv * dv, 2 * hk * dk + 2 * hv * dv
    k = conv_w.shape[1]
    if conv_w.shape[0] != cc or not 2 <= k <= 64:
        raise KernelArgumentError(f"gated delta step: conv weight {list(conv_w.shape)} for {cc} channels, width 2-64")
    if not 0 < (e1 + 2 * hv + 2 * cc + 2 * hv * dv) * MAX_ROWS <= INT_MAX or not _real(beta_scale):
        raise KernelArgumentError("gated delta step: sizes too large, or beta_scale not a real number")
    dm = x.shape[-1] if x.dim() else 0
    b = _rows(x, dm)
    if b is None:
        return None
    codes = (
        _proj(qkvz, e1, dm, "in_proj_qkvz"),
        _proj(ba, 2 * hv, dm, "in_proj_ba"),
        _proj(out_proj, dm, hv * dv, "out_proj"),
    )
    states_ok = _state(conv_state, (b, cc, k - 1), "the conv state") and _state(
        rec_state, (b, hv, dk, dv), "the recurrent state"
    )
    norm_w, eps = norm
    if (
        not states_ok
        or None in codes
        or any(p[1] is not None for p in (qkvz, ba, out_proj))
        or not conv_w.is_contiguous()
        or not all(_vec(v, hv) and v is not None for v in (dt_bias, a_log))
        or not (_vec(norm_w, dv) and norm_w is not None and _real(eps))
    ):
        return None
    x = x.contiguous()
    new_conv, new_rec = torch.empty(conv_state.shape, dtype=_F32), torch.empty(rec_state.shape, dtype=_F32)
    y, scratch = torch.empty(x.shape, dtype=_F32), torch.empty(b * (e1 + 2 * hv + 2 * cc + 2 * hv * dv), dtype=_F32)
    args = (
        x.data_ptr(), b, dm, hk, hv, dk, dv, k, qkvz[0].data_ptr(), codes[0], _ptr(qkvz[2]), ba[0].data_ptr(),
        codes[1], _ptr(ba[2]), conv_w.data_ptr(), conv_state.data_ptr(), new_conv.data_ptr(), dt_bias.data_ptr(),
        a_log.data_ptr(), float(beta_scale), rec_state.data_ptr(), new_rec.data_ptr(), norm_w.data_ptr(), float(eps),
        out_proj[0].data_ptr(), codes[2], _ptr(out_proj[2]), scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return args, (y, new_conv, new_rec), (x, scratch)


DECAYS = {"head": 0, "channel": 1, "bounded": 2}  # hc_delta_step's `decay` codes
OUTPUT_GATES = {"silu": 0, "sigmoid": 1}  # its head norm's gate


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v < hi


class DeltaStep:
    """hc_delta_step with its weights checked once (bind_delta_step): `run(x, conv_state, rec_state)` checks only
    those and calls the kernel. Holds the weight tensors it points at (they stay alive while it does)."""

    def __init__(self, lib, sizes: tuple, args: tuple, keep: tuple, scratch_cols: int) -> None:
        self.lib, self.sizes, self.args_bound, self.keep, self.scratch_cols = lib, sizes, args, keep, scratch_cols

    def args(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor) -> tuple | None:
        """x [B, 1, Dm], conv_state [B, 2 Hk Dk + Hv Dv, K-1], rec_state [B, Hv, Dk, Dv] -> (hc_delta_step's
        arguments, its outputs (y [B, 1, Dm], the new conv state, the new recurrent state), the tensors they point
        into); None where the kernel does not take them."""
        dm, hk, hv, dk, dv, k, cc = self.sizes
        b = _rows(x, dm) if isinstance(x, torch.Tensor) else None
        if b is None:
            return None
        states_ok = _state(conv_state, (b, cc, k - 1), "the conv state") and _state(
            rec_state, (b, hv, dk, dv), "the recurrent state"
        )
        if not states_ok:
            return None
        x = x.contiguous()
        new_conv, new_rec = torch.empty(conv_state.shape, dtype=_F32), torch.empty(rec_state.shape, dtype=_F32)
        y, scratch = torch.empty(x.shape, dtype=_F32), torch.empty(b * self.scratch_cols, dtype=_F32)
        head, tail = self.args_bound
        args = (
            x.data_ptr(), b, dm, hk, hv, dk, dv, k, *head, conv_state.data_ptr(), new_conv.data_ptr(), *tail[:8],
            rec_state.data_ptr(), new_rec.data_ptr(), *tail[8:], scratch.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        return args, (y, new_conv, new_rec), (x, scratch, self)  # (self: the weight arrays it points at)

    def run(
        self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`args`' call run: (y [B, 1, Dm], the new conv state, the new recurrent state), or None (not taken)."""
        got = self.args(x, conv_state, rec_state)
        if got is None:
            return None
        self.lib.hc_delta_step(*got[0])
        return got[1]


def bind_delta_step(
    heads: tuple[int, int, int, int],
    projs: list[tuple],
    n_qkv: int,
    fields: tuple[int, int, int],
    conv_ws: list[torch.Tensor],
    decay: tuple[str, torch.Tensor, torch.Tensor, float],
    beta_scale: float,
    norm: tuple[str, torch.Tensor, float],
    out_proj: tuple,
) -> DeltaStep | None:
    """delta_step's weights checked once (its arguments less x and the states; the model width is the first
    projection's input, which reads x) -> a DeltaStep, or None where the kernel does not take them."""
    lib = _library()
    if lib is None:
        return None
    if len(heads) != 4 or not all(type(v) is int and v >= 1 for v in heads) or heads[1] % heads[0]:
        raise KernelArgumentError(f"delta step: heads must be (Hk, Hv, Dk, Dv) >= 1 with Hk | Hv, got {heads}")
    hk, hv, dk, dv = heads
    kd, vd = hk * dk, hv * dv
    cc = 2 * kd + vd
    if not 1 <= len(projs) <= 8 or not all(isinstance(p, tuple) and len(p) == 4 for p in projs):
        raise KernelArgumentError("delta step: projs must be 1 to 8 (weight, bias, scale, src) tuples")
    rows: list[int] = []
    for j, (w, _, _, src) in enumerate(projs):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not (src is None or _int(src, 0, j)):
            raise KernelArgumentError(f"delta step: projection {j} needs a weight matrix and an earlier source")
        rows.append(w.shape[0])
    dm = projs[0][0].shape[1]
    if not _int(n_qkv, 1, len(projs) + 1) or sum(rows[:n_qkv]) != cc or len(conv_ws) != n_qkv:
        raise KernelArgumentError(f"delta step: the first {n_qkv} projections must give {cc} conv channels")
    if len(fields) != 3 or not all(_int(f, 0, len(projs)) for f in fields) or decay[0] not in DECAYS:
        raise KernelArgumentError(f"delta step: fields must index projs, decay one of {list(DECAYS)}")
    kind, dt_bias, a_log, lower = decay
    wa = hv if kind == "head" else hv * dk
    if [rows[f] for f in fields] != [vd, hv, wa]:
        raise KernelArgumentError(f"delta step: the z / b / a projections must give {vd} / {hv} / {wa} outputs")
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == n for w, n in zip(conv_ws, rows)):
        raise KernelArgumentError("delta step: each conv weight must be [its projection's outputs, K]")
    k = conv_ws[0].shape[1]
    if any(w.shape[1] != k for w in conv_ws) or not 2 <= k <= 64:
        raise KernelArgumentError(f"delta step: the conv weights need one width in [2, 64], got {k}")
    if norm[0] not in OUTPUT_GATES or not all(_real(v) for v in (lower, beta_scale, norm[2])):
        raise KernelArgumentError(f"delta step: the norm's gate one of {list(OUTPUT_GATES)}, real scalars")
    scratch_cols = sum(rows) + cc + 2 * vd + hv * dk
    if not 0 < scratch_cols * MAX_ROWS <= INT_MAX:
        raise KernelArgumentError("delta step: sizes too large")
    codes = [_proj((w, bias, s), rows[j], dm if src is None else rows[src], f"projection {j}")
             for j, (w, bias, s, src) in enumerate(projs)]  # fmt: skip
    out_code = _proj(out_proj, dm, vd, "out_proj")
    if (
        None in codes
        or out_code is None
        or any(p[1] is not None for p in projs)
        or out_proj[1] is not None
        or not all(_vec(w.reshape(-1), w.numel()) and w.is_contiguous() for w in conv_ws)
        or not (_vec(dt_bias, wa) and _vec(a_log, hv) and _vec(norm[1], dv))
        or None in (dt_bias, a_log, norm[1])
    ):
        return None
    n = len(projs)
    arrays = (
        (ctypes.c_void_p * n)(*(p[0].data_ptr() for p in projs)),
        (ctypes.c_int * n)(*codes),
        (ctypes.c_void_p * n)(*(_ptr(p[2]) for p in projs)),
        (ctypes.c_int * n)(*rows),
        (ctypes.c_int * n)(*(-1 if p[3] is None else p[3] for p in projs)),
    )
    convs = (ctypes.c_void_p * n_qkv)(*(w.data_ptr() for w in conv_ws))
    head = (n, *(ctypes.addressof(a) for a in arrays), n_qkv, ctypes.addressof(convs))  # (addresses: a record's fields)
    tail = (*fields, DECAYS[kind], float(lower), dt_bias.data_ptr(), a_log.data_ptr(), float(beta_scale))
    tail += (OUTPUT_GATES[norm[0]], norm[1].data_ptr(), float(norm[2]), out_proj[0].data_ptr(), out_code)
    tail += (_ptr(out_proj[2]),)
    keep = (projs, conv_ws, dt_bias, a_log, norm, out_proj, arrays, convs)
    return DeltaStep(lib, (dm, hk, hv, dk, dv, k, cc), (head, tail), keep, scratch_cols)


def delta_step(
    x: torch.Tensor,
    heads: tuple[int, int, int, int],
    projs: list[tuple],
    n_qkv: int,
    fields: tuple[int, int, int],
    conv_ws: list[torch.Tensor],
    conv_state: torch.Tensor,
    decay: tuple[str, torch.Tensor, torch.Tensor, float],
    beta_scale: float,
    rec_state: torch.Tensor,
    norm: tuple[str, torch.Tensor, float],
    out_proj: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A delta-rule mixer with separate projections (Qwen3.5, OLMo-Hybrid, KDA) on one token: x [B, 1, Dm], heads
    (Hk, Hv, Dk, Dv), projs [(weight, bias, scale, src)] (src None: reads x; else the index of an earlier projection
    whose output it reads; the first reads x), the first n_qkv of them the conv input [q | k | v] with their conv
    weights conv_ws ([rows, K] each, no bias), conv_state [B, 2 Hk Dk + Hv Dv, K-1], fields (z, b, a): the
    projections of the output gate [Hv Dv], beta's logits [Hv] and the decay's logits, decay (DECAYS kind, dt_bias,
    A_log [Hv], lower_bound), beta's scale, rec_state [B, Hv, Dk, Dv], norm (OUTPUT_GATES kind, weight [Dv], eps),
    out_proj (weight [Dm, Hv Dv], no bias, scale) -> (y [B, 1, Dm], the new conv state, the new recurrent state).
    (bind_delta_step + DeltaStep.run in one call.)"""
    if _library() is None or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    bound = bind_delta_step(heads, projs, n_qkv, fields, conv_ws, decay, beta_scale, norm, out_proj)
    return None if bound is None else bound.run(x, conv_state, rec_state)


def rglru_args(
    x: torch.Tensor,
    heads: int,
    y_proj: tuple,
    x_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    conv_state: torch.Tensor,
    gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    recurrent_param: torch.Tensor,
    positions: torch.Tensor,
    lru_state: torch.Tensor,
    out_proj: tuple,
) -> tuple[tuple, tuple, tuple] | None:
    """RecurrentGemma's recurrent block on one token (gelu-tanh branch): x [B, 1, Dm], H heads, linear_y / linear_x
    (weight [W, Dm], bias, scale), the conv weight [W, K] and bias, conv_state [B, W, K-1], the gates (input weight
    [H, W/H, W/H], its bias [H, W/H], recurrence weight, its bias), recurrent_param [W], positions [B, 1] (int64: 0
    at a row's first token, where the LRU restarts), lru_state [B, W], linear_out (weight [Dm, W], bias, scale) ->
    (y [B, 1, Dm], the new conv state, the new LRU state)."""
    lib = _library()
    if lib is None or not isinstance(x, torch.Tensor) or not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2:
        return None
    w, k = conv_w.shape
    if type(heads) is not int or heads < 1 or w % heads or not 2 <= k <= 64 or not 0 < 5 * w * MAX_ROWS <= INT_MAX:
        raise KernelArgumentError(f"rglru step: {w} channels in {heads} heads, conv width {k} outside [2, 64]")
    bw = w // heads
    if len(gates) != 4 or not all(isinstance(g, torch.Tensor) for g in gates):
        raise KernelArgumentError("rglru step: gates must be (input weight, input bias, recurrence weight, its bias)")
    for g, shape in zip(gates, ((heads, bw, bw), (heads, bw)) * 2, strict=True):
        if tuple(g.shape) != shape:
            raise KernelArgumentError(f"rglru step: a gate tensor must be {list(shape)}, got {list(g.shape)}")
    dm = x.shape[-1] if x.dim() else 0
    b = _rows(x, dm)
    if b is None:
        return None
    codes = (_proj(y_proj, w, dm, "linear_y"), _proj(x_proj, w, dm, "linear_x"), _proj(out_proj, dm, w, "linear_out"))
    if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (b, 1):
        raise KernelArgumentError(f"rglru step: positions must be [{b}, 1]")
    states_ok = _state(conv_state, (b, w, k - 1), "the conv state") and _state(lru_state, (b, w), "the LRU state")
    if (
        not states_ok
        or None in codes
        or not conv_w.is_contiguous()
        or not all(_vec(g.reshape(-1), g.numel()) and g.is_contiguous() for g in gates)
        or not (_vec(conv_b, w) and _vec(recurrent_param, w) and recurrent_param is not None)
        or not (positions.dtype == torch.int64 and positions.is_cpu and positions.is_contiguous())
    ):
        return None
    x = x.contiguous()
    new_conv, new_lru = torch.empty(conv_state.shape, dtype=_F32), torch.empty(lru_state.shape, dtype=_F32)
    y, scratch = torch.empty(x.shape, dtype=_F32), torch.empty(b * 4 * w + w, dtype=_F32)
    (w_y, b_y, s_y), (w_x, b_x, s_x), (w_o, b_o, s_o) = y_proj, x_proj, out_proj
    args = (
        x.data_ptr(), b, dm, w, heads, k, w_y.data_ptr(), codes[0], _ptr(s_y), _ptr(b_y), w_x.data_ptr(), codes[1],
        _ptr(s_x), _ptr(b_x), conv_w.data_ptr(), _ptr(conv_b), conv_state.data_ptr(), new_conv.data_ptr(),
        *(g.data_ptr() for g in gates), recurrent_param.data_ptr(), positions.data_ptr(), lru_state.data_ptr(),
        new_lru.data_ptr(), w_o.data_ptr(), codes[2], _ptr(s_o), _ptr(b_o), scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return args, (y, new_conv, new_lru), (x, scratch, positions)


def mamba_groups_args(
    x: torch.Tensor,
    in_proj: tuple,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    conv_state: torch.Tensor,
    x_w: torch.Tensor,
    dt_w: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    d_skip: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out_proj: tuple,
) -> tuple[tuple, tuple, tuple] | None:
    """Zamba's Mamba1 mixer on one token: x [B, 1, Dm], in_proj (weight [2 Di, Dm]: u and the gate interleaved per
    channel, bias, scale), the conv weight [Di, K] and bias, conv_state [B, Di, K-1], the per-group x_proj [G, R + 2N,
    Di/G] and dt_proj [G, Di/G, R] (float32), dt_bias [Di] (inside the softplus), A_log [Di, N], D [Di], ssm_state
    [B, Di, N], out_proj (weight [Dm, Di], bias, scale) -> (y [B, 1, Dm], the new conv state, the new ssm state)."""
    lib = _library()
    if lib is None or not isinstance(x, torch.Tensor) or not isinstance(a_log, torch.Tensor) or a_log.dim() != 2:
        return None
    di, n = a_log.shape
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (x_w, dt_w)):
        raise KernelArgumentError("mamba groups step: x_proj and dt_proj must be [G, R + 2N, Di/G] and [G, Di/G, R]")
    g, w_rows, dh = x_w.shape
    r = w_rows - 2 * n
    if g < 1 or dh * g != di or r < 1 or tuple(dt_w.shape) != (g, dh, r):
        raise KernelArgumentError(f"mamba groups step: x_proj {list(x_w.shape)}, dt_proj {list(dt_w.shape)} for {di}")
    if not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 2 or conv_w.shape[0] != di:
        raise KernelArgumentError(f"mamba groups step: the conv weight must be [{di}, K]")
    k = conv_w.shape[1]
    if not 2 <= k <= 64 or not 0 < (6 * di + g * (r + 2 * n)) * MAX_ROWS + di * n <= INT_MAX:
        raise KernelArgumentError(f"mamba groups step: conv width {k} outside [2, 64], or sizes too large")
    dm = x.shape[-1] if x.dim() else 0
    b = _rows(x, dm)
    if b is None:
        return None
    codes = (_proj(in_proj, 2 * di, dm, "in_proj"), _proj(out_proj, dm, di, "out_proj"))
    states_ok = _state(conv_state, (b, di, k - 1), "the conv state") and _state(ssm_state, (b, di, n), "the state")
    if (
        not states_ok
        or None in codes
        or not all(_vec(t.reshape(-1), t.numel()) and t.is_contiguous() for t in (conv_w, x_w, dt_w, a_log))
        or not all(_vec(v, di) for v in (conv_b, dt_bias, d_skip))
        or dt_bias is None
    ):
        return None
    x = x.contiguous()
    new_conv, new_ssm = torch.empty(conv_state.shape, dtype=_F32), torch.empty(ssm_state.shape, dtype=_F32)
    y, scratch = torch.empty(x.shape, dtype=_F32), torch.empty(b * (6 * di + g * (r + 2 * n)), dtype=_F32)
    (w_in, b_in, s_in), (w_out, b_out, s_out) = in_proj, out_proj
    args = (
        x.data_ptr(), b, dm, di, n, k, r, g, w_in.data_ptr(), codes[0], _ptr(s_in), _ptr(b_in), conv_w.data_ptr(),
        _ptr(conv_b), conv_state.data_ptr(), new_conv.data_ptr(), x_w.data_ptr(), dt_w.data_ptr(),
        dt_bias.data_ptr(), a_log.data_ptr(), _ptr(d_skip), ssm_state.data_ptr(), new_ssm.data_ptr(),
        w_out.data_ptr(), codes[1], _ptr(s_out), _ptr(b_out), scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return args, (y, new_conv, new_ssm), (x, scratch)


def _call(fn: str, prepared: tuple | None) -> tuple | None:
    """Run a `*_args` result's C call; its outputs (None: not taken, nothing run)."""
    if prepared is None:
        return None
    args, outputs, _alive = prepared  # (_alive: what args point into, referenced until the call returns)
    getattr(_library(), fn)(*args)
    return outputs


def short_conv_step(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """short_conv_args' arguments -> (y [B, 1, D], the new state), or None (not taken)."""
    return _call("hc_short_conv_step", short_conv_args(*args, **kwargs))


def mamba_step(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mamba_args' arguments -> (y [B, 1, Dm], the new conv state, the new ssm state), or None (not taken)."""
    return _call("hc_mamba_step", mamba_args(*args, **kwargs))


def gated_delta_step(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """gated_delta_args' arguments -> (y [B, 1, Dm], the new conv state, the new recurrent state), or None."""
    return _call("hc_gated_delta_step", gated_delta_args(*args, **kwargs))


def rglru_step(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """rglru_args' arguments -> (y [B, 1, Dm], the new conv state, the new LRU state), or None (not taken)."""
    return _call("hc_rglru_step", rglru_args(*args, **kwargs))


def mamba_groups_step(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mamba_groups_args' arguments -> (y [B, 1, Dm], the new conv state, the new ssm state), or None."""
    return _call("hc_mamba_groups_step", mamba_groups_args(*args, **kwargs))

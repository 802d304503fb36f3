"""Mamba1 selective scan with an explicit initial / final SSM state.

Recurrence (per channel d, state dim n), after delta += delta_bias and an
optional softplus:
    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t
    y_t = <h_t, C_t> + D * u_t ;  y_t *= silu(z_t) if z is given
The recurrence runs in float32 (float64 for float64 inputs); y is returned in
u.dtype and the state in the accumulation dtype. On CUDA the ``mamba_ssm``
kernels are used when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._dispatch import acc_dtype, cuda_kernel

# Max elements of each [B, Tc, Dm, N] work tensor; bounds memory for long T.
_CHUNK_ELEMS = 1 << 22


def _delta(delta, delta_bias, delta_softplus, acc, bias_shape):
    d = delta.to(acc)
    if delta_bias is not None:
        d = d + delta_bias.to(acc).reshape(bias_shape)
    return F.softplus(d) if delta_softplus else d


def _skip_and_gate(y, uf, D, z, acc):
    """y + D * u (D already broadcast to u's layout) and then y * silu(z), each when given."""
    if D is not None:
        y = y + D.to(acc) * uf
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y


def _f32(x):
    return x.float() if x is not None else None


def _time_chunk(b: int, dm: int, n: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, b * dm * n))


def _selective_scan_torch(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, state=None):
    """Reference scan: sequential over time, vectorised in time chunks."""
    bsz, dm, t = u.shape
    n = A.shape[-1]
    acc = acc_dtype(u, state)
    uf = u.to(acc)
    dt = _delta(delta, delta_bias, delta_softplus, acc, (dm, 1))  # [B, Dm, T]
    Af = A.to(acc)
    h = state.to(acc) if state is not None else uf.new_zeros(bsz, dm, n)  # [B, Dm, N]

    ys = []
    step = _time_chunk(bsz, dm, n)
    for t0 in range(0, t, step):
        sl = slice(t0, t0 + step)
        dA = torch.exp(torch.einsum("bdt,dn->btdn", dt[..., sl], Af))  # [B, Tc, Dm, N]
        dBu = torch.einsum("bdt,bnt->btdn", dt[..., sl] * uf[..., sl], B[..., sl].to(acc))
        hs = []
        for i in range(dA.shape[1]):
            h = torch.addcmul(dBu[:, i], dA[:, i], h)
            hs.append(h)
        ys.append(torch.einsum("btdn,bnt->bdt", torch.stack(hs, 1), C[..., sl].to(acc)))
    y = torch.cat(ys, dim=-1) if ys else uf.new_zeros(bsz, dm, 0)  # [B, Dm, T]
    y = _skip_and_gate(y, uf, D[:, None] if D is not None else None, z, acc)
    return y.to(u.dtype), (h if t > 0 else h.clone())


def _with_initial_state(zero_start_scan: Callable, u, delta, A, B, C, D, z, delta_bias, delta_softplus, state):
    """Run a zero-initial-state scan and add the (linear) contribution of ``state``.

    The state's effect on y_t is <exp(A * sum_{s<=t} delta_s) * h0, C_t>, and on
    the final state exp(A * sum_s delta_s) * h0; it is added before the z gate.
    ``zero_start_scan`` has the ``mamba_ssm.selective_scan_fn`` signature.
    """
    y, last = zero_start_scan(u, delta, A, B, C, D, None, delta_bias, delta_softplus, return_last_state=True)
    bsz, dm, t = u.shape
    acc = acc_dtype(u, state)
    h0 = state.to(acc)  # [B, Dm, N]
    Af = A.to(acc)
    cum = torch.cumsum(_delta(delta, delta_bias, delta_softplus, acc, (dm, 1)), dim=-1)  # [B, Dm, T]
    y = y.to(acc)
    step = _time_chunk(bsz, dm, A.shape[-1])
    parts = []
    for t0 in range(0, t, step):
        sl = slice(t0, t0 + step)
        decay = torch.exp(torch.einsum("bdt,dn->bdtn", cum[..., sl], Af))  # [B, Dm, Tc, N]
        parts.append(torch.einsum("bdtn,bnt->bdt", decay * h0[:, :, None], C[..., sl].to(acc)))
    if parts:
        y = y + torch.cat(parts, dim=-1)
        last = last.to(acc) + torch.exp(cum[..., -1:] * Af) * h0
    else:
        last = h0.clone()
    return _skip_and_gate(y, None, None, z, acc).to(u.dtype), last.to(acc)


def _selective_scan_kernel(kernel, u, delta, A, B, C, D, z, delta_bias, delta_softplus, state):
    dt = u.dtype
    D, delta_bias = _f32(D), _f32(delta_bias)
    args = (u, delta.to(dt), A.float(), B.to(dt), C.to(dt), D)
    if state is None:
        y, last = kernel(*args, z.to(dt) if z is not None else None, delta_bias, delta_softplus, return_last_state=True)
        return y, last.float()
    # selective_scan_fn has no initial-state argument: superpose its contribution.
    return _with_initial_state(kernel, *args, z, delta_bias, delta_softplus, state)


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1 selective scan over a sequence.

    Args:
        u, delta, z: [B, Dm, T]; A: [Dm, N]; B, C: [B, N, T]; D, delta_bias: [Dm];
        state: [B, Dm, N] initial SSM state (None = zeros).

    Returns:
        y [B, Dm, T] in u.dtype, final_state [B, Dm, N] float32 (float64 for float64 inputs).
    """
    kernel = None
    if u.shape[-1] > 0:
        kernel = cuda_kernel("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn", u)
    if kernel is not None:
        return _selective_scan_kernel(kernel, u, delta, A, B, C, D, z, delta_bias, delta_softplus, state)
    return _selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, state)


def _selective_state_update_torch(state, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    acc = acc_dtype(u, state)
    uf = u.to(acc)
    dt = _delta(delta, delta_bias, delta_softplus, acc, (-1,))  # [B, Dm]
    dA = torch.exp(dt[..., None] * A.to(acc))  # [B, Dm, N]
    dBu = (dt * uf)[..., None] * B.to(acc)[:, None, :]  # [B, Dm, N]
    h = dA * state.to(acc) + dBu  # new tensor, input untouched
    y = torch.einsum("bdn,bn->bd", h, C.to(acc))
    return _skip_and_gate(y, uf, D, z, acc).to(u.dtype), h


def selective_state_update(
    state: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Mamba1 decoding step (same math as ``selective_scan`` with T=1).

    Args: state [B, Dm, N]; u, delta, z [B, Dm]; A [Dm, N]; B, C [B, N]; D, delta_bias [Dm].
    Returns: y [B, Dm] in u.dtype and a *new* state [B, Dm, N] float32 (input not modified).
    """
    kernel = cuda_kernel("mamba_ssm.ops.triton.selective_state_update", "selective_state_update", state, u)
    if kernel is not None:
        new_state = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        y = kernel(
            new_state, u, delta, A.float(), B, C, D=_f32(D), z=z, dt_bias=_f32(delta_bias), dt_softplus=delta_softplus
        )
        return y.to(u.dtype), new_state
    return _selective_state_update_torch(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)

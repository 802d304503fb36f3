"""Mamba2 state-space duality (SSD) scan with an explicit initial / final state.

Per head h (group g = h // (H // G)), after dt += dt_bias, optional softplus and
clamping to dt_limit:
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t      # [P, N]
    y_t = h_t @ C_t + D * x_t                                   # [P]
``ssd_scan`` uses the chunked SSD form: a masked quadratic ("attention-like")
form inside each chunk plus sequential state passing between chunks. Math runs
in float32 (float64 for float64 inputs); y is returned in x.dtype. On CUDA the
``mamba_ssm`` Triton kernels are used when importable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from ._dispatch import acc_dtype, cuda_kernel

_NO_LIMIT = (0.0, math.inf)


def _dt(dt, dt_bias, dt_softplus, dt_limit, acc):
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = F.softplus(d)
    return torch.clamp(d, min=dt_limit[0], max=dt_limit[1])


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L] with out[i, j] = sum_{j<k<=i} a[k] (i >= j), -inf above the diagonal.

    Built by a masked cumulative sum rather than cumsum differences, so it is
    exact-zero on the diagonal and free of cancellation inside the chunk.
    """
    n = a.shape[-1]
    idx = torch.arange(n, device=a.device)
    rows, cols = idx[:, None], idx[None, :]  # row = summed position k / output i, col = j
    terms = torch.where(rows > cols, a[..., :, None], torch.zeros((), dtype=a.dtype, device=a.device))
    out = torch.cumsum(terms, dim=-2)
    return out.masked_fill(rows < cols, float("-inf"))


def _check_heads(h: int, g: int) -> None:
    if h % g != 0:
        raise ValueError(f"number of heads H={h} must be a multiple of groups G={g}")


# Chunks handled at once by the vectorized scan: bounds the [B, H, K, L, L] intra-chunk weights to ~64 MiB.
_GROUP_BYTES = 64 << 20


def _ssd_chunks(xdt, dA, bc, cc, h):
    """K whole chunks at once. xdt [B, G, R, K, L, P]; dA [B, G, R, K, L]; bc, cc [B, K, L, G, N];
    h [B, G, R, P, N] the state entering the first chunk. Returns y [B, G, R, K, L, P] and the state after the last."""
    cum = torch.cumsum(dA, dim=-1)  # [B, G, R, K, L]
    # 1. intra-chunk: y_l += sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    scores = torch.einsum("bklgn,bksgn->bgkls", cc, bc)  # [B, G, K, L, S]
    y = torch.einsum("bgrkls,bgrksp->bgrklp", scores[:, :, None] * torch.exp(_segsum(dA)), xdt)
    # 2. each chunk's own contribution to the state at its end (suffix sums: no cancellation of long cumsums)
    suffix = torch.flip(torch.cumsum(torch.flip(dA, [-1]), dim=-1), [-1])  # sum_{k>=l}
    to_end = torch.exp(torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1))  # sum_{k>l}
    own = torch.einsum("bksgn,bgrksp->bgrkpn", bc, xdt * to_end[..., None])  # [B, G, R, K, P, N]
    # 3. the state entering each chunk: h and the earlier chunks' states, decayed across the chunks in between
    total = F.pad(suffix[..., 0], (1, 0))  # [B, G, R, K+1]: 0, then each chunk's whole log-decay
    states = torch.cat([h[:, :, :, None], own], dim=3)  # [B, G, R, K+1, P, N]
    states = torch.einsum("bgrzk,bgrkpn->bgrzpn", torch.exp(_segsum(total)), states)
    # 4. incoming state: y_l += exp(cum_l) * (h_in @ C_l)
    y = y + torch.einsum("bklgn,bgrkpn->bgrklp", cc, states[:, :, :, :-1]) * torch.exp(cum)[..., None]
    return y, states[:, :, :, -1]


def _ssd_scan_torch(
    x, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, dt_softplus=False, dt_limit=_NO_LIMIT, state=None
):
    """Pure-torch chunked SSD: whole groups of chunks per step (no Python loop per chunk), memory bounded."""
    bsz, t, nh, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _check_heads(nh, g)
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    acc = acc_dtype(x, state)
    xf = x.to(acc)
    dtf = _dt(dt, dt_bias, dt_softplus, dt_limit, acc)  # [B, T, H]
    a = rearrange(A.to(acc), "(g r) -> g r 1 1", g=g)  # [G, R, 1, 1]
    if state is None:
        h = xf.new_zeros(bsz, g, nh // g, p, n)
    else:
        h = rearrange(state.to(acc), "b (g r) p n -> b g r p n", g=g)  # [B, G, R, P, N]
    if t == 0:
        return xf.new_zeros(bsz, 0, nh, p).to(x.dtype), rearrange(h, "b g r p n -> b (g r) p n").clone()
    L = min(chunk_size, t)
    pad = -t % L  # padded steps have dt = 0: no decay and no input, so the state passes through unchanged
    chunks = (t + pad) // L
    xdt = F.pad(xf * dtf[..., None], (0, 0, 0, 0, 0, pad))  # [B, T', H, P]
    xdt = rearrange(xdt, "b (k l) (g r) p -> b g r k l p", l=L, g=g)
    dA = rearrange(F.pad(dtf, (0, 0, 0, pad)), "b (k l) (g r) -> b g r k l", l=L, g=g) * a
    bc, cc = (rearrange(F.pad(v.to(acc), (0, 0, 0, 0, 0, pad)), "b (k l) g n -> b k l g n", l=L) for v in (B, C))
    per_chunk = bsz * nh * L * L * torch.empty((), dtype=acc).element_size()
    group = max(1, _GROUP_BYTES // per_chunk)
    ys = []
    for k0 in range(0, chunks, group):
        sl = slice(k0, k0 + group)
        y, h = _ssd_chunks(xdt[:, :, :, sl], dA[:, :, :, sl], bc[:, sl], cc[:, sl], h)
        ys.append(y)
    y = rearrange(torch.cat(ys, dim=3), "b g r k l p -> b (k l) (g r) p")[:, :t]
    if D is not None:
        y = y + D.to(acc)[:, None] * xf
    return y.to(x.dtype), rearrange(h, "b g r p n -> b (g r) p n")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD scan over a sequence.

    Args:
        x: [B, T, H, P]; dt: [B, T, H]; A: [H] (negative); B, C: [B, T, G, N];
        D, dt_bias: [H]; state: [B, H, P, N] initial state (None = zeros).
        chunk_size only affects speed/memory (and rounding), never the math.

    Returns:
        y [B, T, H, P] in x.dtype, final_state [B, H, P, N] float32 (float64 for float64 inputs).
    """
    kernel = None
    if x.shape[1] > 0:
        kernel = cuda_kernel("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", x)
    if kernel is not None:
        _check_heads(x.shape[2], B.shape[2])
        kchunk = max(16, 1 << (max(chunk_size, 1) - 1).bit_length())  # power of two >= 16
        y, final = kernel(
            x,
            dt,
            A.float(),
            B.to(x.dtype),
            C.to(x.dtype),
            kchunk,
            D=D.float() if D is not None else None,
            dt_bias=dt_bias.float() if dt_bias is not None else None,
            initial_states=state.float() if state is not None else None,
            dt_softplus=dt_softplus,
            dt_limit=tuple(dt_limit),
            return_final_states=True,
        )
        return y.to(x.dtype), final.float()
    return _ssd_scan_torch(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, state)


def _ssd_step_torch(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=_NO_LIMIT):
    g = B.shape[1]
    _check_heads(x.shape[1], g)
    acc = acc_dtype(x, state)
    xg = rearrange(x.to(acc), "b (g r) p -> b g r p", g=g)
    dtg = rearrange(_dt(dt, dt_bias, dt_softplus, dt_limit, acc), "b (g r) -> b g r", g=g)
    decay = torch.exp(dtg * rearrange(A.to(acc), "(g r) -> g r", g=g))  # [B, G, R]
    h = rearrange(state.to(acc), "b (g r) p n -> b g r p n", g=g)
    h = decay[..., None, None] * h + torch.einsum("bgrp,bgn->bgrpn", xg * dtg[..., None], B.to(acc))
    y = torch.einsum("bgrpn,bgn->bgrp", h, C.to(acc))
    y = rearrange(y, "b g r p -> b (g r) p")
    if D is not None:
        y = y + D.to(acc)[:, None] * x.to(acc)
    return y.to(x.dtype), rearrange(h, "b g r p n -> b (g r) p n")


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Mamba2 decoding step (same math as ``ssd_scan`` with T=1, dt_limit included).

    Args: state [B, H, P, N]; x [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N].
    Returns: y [B, H, P] in x.dtype and a *new* state [B, H, P, N] float32.
    """
    kernel = cuda_kernel("mamba_ssm.ops.triton.selective_state_update", "selective_state_update", state, x)
    if kernel is not None:
        bsz, nh, p = x.shape
        n = B.shape[-1]
        _check_heads(nh, B.shape[1])
        # The kernel has no dt_limit: pre-process dt here, then hand it over as-is.
        # Stride-0 (expanded) A / dt / dt_bias select the kernel's tied-head-dim path,
        # which dereferences dt_bias, so a zero bias is passed rather than None.
        dtp = _dt(dt, dt_bias, dt_softplus, dt_limit, torch.float32)
        new_state = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        y = kernel(
            new_state,
            x,
            dtp[..., None].expand(bsz, nh, p),
            A.float()[:, None, None].expand(nh, p, n),
            B,
            C,
            D=D.float()[:, None].expand(nh, p) if D is not None else None,
            z=None,
            dt_bias=dtp.new_zeros(nh, 1).expand(nh, p),
            dt_softplus=False,
        )
        return y.to(x.dtype), new_state
    return _ssd_step_torch(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)

"""Diagonal linear recurrence used by the RG-LRU (Griffin / RecurrentGemma).

The input/recurrence gates (and the sqrt(1 - a^2) input normalisation) belong
to the model block; this module only provides the scan h_t = a_t * h_{t-1} + x_t.
"""

from __future__ import annotations

import torch

from ._dispatch import acc_dtype


def linear_recurrence(
    a: torch.Tensor, x: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan h_t = a_t * h_{t-1} + x_t in float32 (float64 for float64 inputs).

    Args:
        a, x: [B, T, W] per-step decay and input.
        state: [B, W] state before the first step (None = zeros).

    Returns:
        h [B, T, W] in x.dtype and final_state [B, W] in the accumulation dtype.
    """
    bsz, t, w = x.shape
    acc = acc_dtype(x, a, state)
    af, xf = a.to(acc), x.to(acc)
    h = state.to(acc) if state is not None else xf.new_zeros(bsz, w)  # [B, W]
    hs = []
    for i in range(t):
        h = torch.addcmul(xf[:, i], af[:, i], h)
        hs.append(h)
    out = torch.stack(hs, dim=1) if hs else xf.new_zeros(bsz, 0, w)  # [B, T, W]
    return out.to(x.dtype), (h if t > 0 else h.clone())

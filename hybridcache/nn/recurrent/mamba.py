"""Mamba1 selective-SSM mixer (Mamba, Jamba). Its conv and SSM states live only in its `mamba` cache layer."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridcache.cache import MambaStateLayer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.linear import linear
from hybridcache.nn.core.norms import RMSNorm
from hybridcache.ops import causal_conv1d, causal_conv1d_step, selective_state_update
from hybridcache.ops.selective_scan_btd import selective_scan_btd


def resolve_dt_rank(rank: int | str, hidden: int) -> int:
    """HF's `time_step_rank` / `mamba_dt_rank`: an int, or "auto" = ceil(hidden / 16)."""
    return math.ceil(hidden / 16) if rank == "auto" else int(rank)


class MambaMixer(nn.Module):
    """in_proj -> causal conv -> x_proj (dt, B, C) -> selective scan gated by z -> out_proj (HF names).

    `inner_norms=True` adds Jamba's RMSNorms on dt, B and C (dt_layernorm, b_layernorm, c_layernorm).
    Padding tokens are zeroed before the conv and before the scan, so they leave both states untouched.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        state_size: int,
        conv_kernel: int,
        dt_rank: int,
        *,
        conv_bias: bool = True,
        proj_bias: bool = False,
        activation: str = "silu",
        inner_norms: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"unsupported Mamba activation '{activation}' (supported: silu)")
        self.intermediate, self.state_size, self.dt_rank = intermediate, state_size, dt_rank
        self.in_proj = nn.Linear(hidden, 2 * intermediate, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            intermediate, intermediate, conv_kernel, groups=intermediate, padding=conv_kernel - 1, bias=conv_bias
        )
        self.x_proj = nn.Linear(intermediate, dt_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(dt_rank, intermediate, bias=True)
        # made by a factory (so a load builds it on the meta device: [Di, N] may be gigabytes from a forged config),
        # then S4D-real initialised, log(1..N) per channel, where it is real
        self.A_log = nn.Parameter(torch.empty(intermediate, state_size, dtype=torch.float32))
        if not self.A_log.is_meta:
            with torch.no_grad():
                self.A_log.copy_(torch.arange(1, state_size + 1, dtype=torch.float32).log().expand(intermediate, -1))
        self.D = nn.Parameter(torch.ones(intermediate))
        self.out_proj = nn.Linear(intermediate, hidden, bias=proj_bias)
        if inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps)
            self.b_layernorm = RMSNorm(state_size, norm_eps)
            self.c_layernorm = RMSNorm(state_size, norm_eps)
        self.inner_norms = inner_norms
        self.accel = None  # hybridcache.accel's fast path for this mixer, once installed

    def _ssm_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """delta (before bias and softplus) [B, T, Di], B and C [B, T, N] from the conv output u [B, T, Di]."""
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.inner_norms:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        return linear(dt, self.dt_proj.weight, None, self.dt_proj._buffers.get("scale")), b, c  # bias: in softplus

    def _project_in(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x and the gate z [B, T, Di] from h [B, T, D]."""
        return self.in_proj(h).chunk(2, dim=-1)

    def _scan(self, u, delta, a, b, c, z, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The selective scan over [B, T, Di] inputs from `state`: y [B, T, Di] and the final state [B, Di, N]."""
        return selective_scan_btd(u, delta, a, b, c, self.D, z, self.dt_proj.bias, delta_softplus=True, state=state)

    def _step(self, state, u, delta, a, b, c, z) -> tuple[torch.Tensor, torch.Tensor]:
        """One token ([B, Di] inputs): y [B, Di] and the new state."""
        return selective_state_update(state, u, delta, a, b, c, self.D, z, self.dt_proj.bias, delta_softplus=True)

    def forward(self, h: torch.Tensor, layer: MambaStateLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        if self.accel is not None:
            out = self.accel(h, layer, step)  # the fast path (a decode step in one call), where it takes this call
            if out is not None:
                return out
        tokens = h.shape[1]
        x, z = self._project_in(h)  # [B, T, Di] each
        x = step.mask_padding(x)  # padding never enters the conv state
        states = layer.states  # conv [B, Di, K-1], ssm [B, Di, N]
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # [Di, K], [Di]
        if tokens == 1:
            xc, conv = causal_conv1d_step(x[:, 0], weight, bias, states["conv"], activation="silu")  # [B, Di]
            xc = xc[:, None]  # [B, 1, Di]
        else:
            xc, conv = causal_conv1d(x.transpose(1, 2), weight, bias, states["conv"], activation="silu")
            xc = xc.transpose(1, 2)  # [B, T, Di]
        u = step.mask_padding(xc)  # padding never enters the SSM state
        delta, b, c = self._ssm_inputs(u)  # [B, T, Di], [B, T, N], [B, T, N]
        a = -torch.exp(self.A_log.float())  # [Di, N]
        m = layer.trail_length(tokens)
        if m > 0:  # rollback on: the last m tokens go through the step path, keeping their states
            return self._forward_with_trail(h, layer, states, x, u, delta, a, b, c, z, conv, m)
        if tokens == 1 and not (u.dtype == torch.float32 and u.is_cpu):  # (float32 CPU: the scan kernel / its op)
            y, ssm = self._step(states["ssm"], u[:, 0], delta[:, 0], a, b[:, 0], c[:, 0], z[:, 0])
            y = y[:, None]  # [B, 1, Di]
        else:
            y, ssm = self._scan(u, delta, a, b, c, z, states["ssm"])  # y [B, T, Di]
        layer.update(conv=conv.to(layer.spec.dtype), ssm=ssm.to(layer.spec.state_dtype))
        return self.out_proj(y.to(h.dtype))

    def _forward_with_trail(self, h, layer, states, x, u, delta, a, b, c, z, conv, m: int) -> torch.Tensor:
        """The scan over the first T - m tokens, then m steps whose incoming states are the layer's trail."""
        from hybridcache.nn.recurrent.trail import conv_trail, stack_trail

        head = u.shape[1] - m
        y, ssm = self._scan(u[:, :head], delta[:, :head], a, b[:, :head], c[:, :head], z[:, :head], states["ssm"])
        ys, trail = [y], []
        for i in range(head, u.shape[1]):
            trail.append(ssm)
            yi, ssm = self._step(ssm, u[:, i], delta[:, i], a, b[:, i], c[:, i], z[:, i])
            ys.append(yi[:, None])
        spec = layer.spec
        layer.update(
            conv=conv.to(spec.dtype),
            ssm=ssm.to(spec.state_dtype),
            trail={
                "conv": conv_trail(states["conv"], x.transpose(1, 2), m).to(spec.dtype),
                "ssm": stack_trail(trail, spec.state_dtype),
            },
        )
        return self.out_proj(torch.cat(ys, dim=1).to(h.dtype))

"""Mamba2 mixer (HF parameter names): in_proj -> causal conv over x, B, C -> SSD scan -> gated RMSNorm -> out_proj.

The conv and SSM states live only in the mixer's `mamba2` cache layer: every block starts from `layer.states`
and writes both back, so a sequence fed in any split gives the same result. Left padding is made invisible by
zeroing the conv input, the conv output and dt at padding positions (decay exp(0 * A) = 1, no input).

Precision: in float32 the projections, conv and scan run in float32 like HF's. A one-row projection (decode) and a
whole block's (BLAS) round apart, and the chunked scan rounds differently from the step; Mamba2 amplifies such
ulp-level differences ~10x, so float32 splits of a sequence end ~2.5e-5 apart in the logits of the tiny test model
(exact in float64). `model.upcast_cpu_float32 = True` runs the conv and scan in float64 on CPU; once the
projections ran in float32 it no longer moved the results closer to a float64 reference (measured on six Mamba2
families) and cost 10-30% of prefill speed, so it is off by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybridcache.cache import CacheLayer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.recurrent.trail import conv_trail, stack_trail
from hybridcache.ops import causal_conv1d, causal_conv1d_step, ssd_scan, ssd_step


def _float(value: Any) -> float:
    """A config float; transformers 5 writes non-finite floats as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, Mapping) else float(value)


class GatedRMSNorm(nn.Module):
    """HF `MambaRMSNormGated`: x * silu(gate), RMS-normalised per group of `group_size` channels (>= float32).

    `norm_before_gate=True` (mamba_ssm option) normalises first and gates after; the weight multiplies the result
    cast back to the input dtype, as in HF.
    """

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False) -> None:
        super().__init__()
        if dim % group_size != 0:
            raise ValueError(f"gated norm: dim {dim} is not a multiple of the group size {group_size}")
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [B, T, I] each
        dtype = x.dtype
        acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 inputs
        h, gate = x.to(acc), gate.to(acc)
        if not self.norm_before_gate:
            h = h * F.silu(gate)
        hg = rearrange(h, "... (g d) -> ... g d", d=self.group_size)  # [B, T, G, I/G]
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.eps)
        h = rearrange(hg, "... g d -> ... (g d)")
        if self.norm_before_gate:
            h = h * F.silu(gate)
        return self.weight * h.to(dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba2 SSD mixer: forward(h [B, T, D], layer, step) -> [B, T, D].

    `use_bias` sets the in_proj and out_proj biases; `out_bias` overrides the latter (FalconH1's projectors_bias).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int = 1,
        conv_kernel: int = 4,
        chunk_size: int = 256,
        *,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        time_step_limit: tuple[Any, Any] = (0.0, math.inf),
        rms_norm: bool = True,
        norm_before_gate: bool = False,
        eps: float = 1e-5,
        activation: str = "silu",
        upcast_cpu_float32: bool = False,
        out_bias: bool | None = None,
    ) -> None:
        super().__init__()
        self.upcast_cpu_float32 = upcast_cpu_float32  # see the module docstring; set per model
        if num_heads % n_groups != 0:
            raise ValueError(f"mamba2: num_heads={num_heads} must be a multiple of n_groups={n_groups}")
        if activation not in ("silu", "swish"):
            raise ValueError(f"mamba2: unsupported conv activation {activation!r} (only silu)")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.chunk_size = chunk_size
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.time_step_limit = (_float(time_step_limit[0]), _float(time_step_limit[1]))
        self.in_proj = nn.Linear(hidden, 2 * self.intermediate + 2 * n_groups * state_size + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, padding=conv_kernel - 1, bias=use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        group = self.intermediate // n_groups
        self.norm = GatedRMSNorm(self.intermediate, group, eps, norm_before_gate) if rms_norm else None
        self.out_proj = nn.Linear(self.intermediate, hidden, bias=use_bias if out_bias is None else out_bias)
        self.accel = None  # hybridcache.accel's fast path for this mixer, once installed

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mamba2Mixer:
        """Build from a HF Mamba2 config dict (HF defaults for missing fields)."""
        hidden = config["hidden_size"]
        num_heads, head_dim = config.get("num_heads", 128), config.get("head_dim", 64)
        if int(config.get("expand", 2) * hidden) != num_heads * head_dim:
            raise ValueError(f"mamba2: expand * hidden_size must equal num_heads * head_dim ({num_heads * head_dim})")
        limit = config.get("time_step_limit") or (0.0, math.inf)
        return cls(
            hidden,
            num_heads,
            head_dim,
            config.get("state_size", 128),
            config.get("n_groups", 8),
            config.get("conv_kernel", 4),
            config.get("chunk_size", 256),
            use_conv_bias=config.get("use_conv_bias", True),
            use_bias=config.get("use_bias", False),
            time_step_limit=tuple(limit),
            rms_norm=config.get("rms_norm", True),
            norm_before_gate=config.get("norm_before_gate", False),
            eps=config.get("layer_norm_epsilon", 1e-5),
            activation=config.get("hidden_act", "silu"),
        )

    def _compute_dtype(self, h: torch.Tensor) -> torch.dtype:
        if self.upcast_cpu_float32 and h.dtype == torch.float32 and h.device.type == "cpu":
            return torch.float64
        return h.dtype

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        if self.accel is not None:
            out = self.accel(h, layer, step)  # the fast path (a decode step in one call), where it takes this call
            if out is not None:
                return out
        dtype, cd, tokens = h.dtype, self._compute_dtype(h), h.shape[1]
        g, n = self.n_groups, self.state_size

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(cd)

        # The projections run in the model's dtype (their output was rounded to it anyway); the float64 upcast is
        # for the conv and the scan, where float32 cached and whole-sequence paths drift apart.
        zxbcdt = self.in_proj(h)  # [B, T, E]
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = step.mask_padding(xbc).to(cd)  # [B, T, C]: padding enters the conv as zeros (= the empty state)
        xbc_in = xbc  # the conv inputs (what the conv state holds)
        states = layer.states
        weight, bias = cast(self.conv1d.weight.squeeze(1)), cast(self.conv1d.bias)  # [C, K], [C]
        if tokens == 1:
            y, conv_state = causal_conv1d_step(xbc[:, 0], weight, bias, states["conv"], "silu")  # [B, C]
            xbc = y[:, None]
        else:
            y, conv_state = causal_conv1d(xbc.transpose(1, 2), weight, bias, states["conv"], "silu")  # [B, C, T]
            xbc = y.transpose(1, 2)
        xbc = step.mask_padding(xbc)  # [B, T, C]
        acc = torch.promote_types(cd, torch.float32)  # the SSD runs in float32 at least (y too, as in HF)
        x, b, c = xbc.to(acc).split([self.intermediate, g * n, g * n], dim=-1)
        # dt: bias, softplus and limit here, so padding can get dt = 0 and leave the SSM state untouched
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc)).clamp(*self.time_step_limit)  # [B, T, H]
        dt = step.mask_padding(dt)
        A, D = -torch.exp(self.A_log.to(acc)), self.D.to(acc)  # [H]
        m = layer.trail_length(tokens)
        if m > 0:  # rollback on: the last m tokens go through the step path, keeping their states
            y, ssm_state, trail = self._scan_with_trail(x, dt, A, b, c, D, states["ssm"], m)
            trail = {
                "conv": conv_trail(states["conv"], xbc_in.transpose(1, 2), m).to(states["conv"].dtype),
                "ssm": stack_trail(trail, states["ssm"].dtype),
            }
        elif tokens == 1:
            y, ssm_state = ssd_step(
                states["ssm"],
                rearrange(x[:, 0], "b (h p) -> b h p", p=self.head_dim),
                dt[:, 0],
                A,
                rearrange(b[:, 0], "b (g n) -> b g n", g=g),
                rearrange(c[:, 0], "b (g n) -> b g n", g=g),
                D,
            )
            y = y[:, None]  # [B, 1, H, P]
        else:
            y, ssm_state = ssd_scan(
                rearrange(x, "b t (h p) -> b t h p", p=self.head_dim),
                dt,
                A,
                rearrange(b, "b t (g n) -> b t g n", g=g),
                rearrange(c, "b t (g n) -> b t g n", g=g),
                self.chunk_size,
                D=D,
                state=states["ssm"],
            )  # y [B, T, H, P]
        layer.update(
            conv=conv_state.to(states["conv"].dtype),
            ssm=ssm_state.to(states["ssm"].dtype),
            **({"trail": trail} if m > 0 else {}),
        )
        y = rearrange(y, "b t h p -> b t (h p)")  # [B, T, I]
        y = self.norm(y, z.to(acc)) if self.norm is not None else y * F.silu(z.to(acc))
        return self.out_proj(y.to(dtype))  # [B, T, D]

    def _scan_with_trail(self, x, dt, A, b, c, D, state, m: int):
        """SSD over the first T - m tokens, then m steps; returns y [B, T, H, P], the final state and the m states
        entering those steps (the layer's trail)."""
        g, head = self.n_groups, x.shape[1] - m
        xh = rearrange(x, "b t (h p) -> b t h p", p=self.head_dim)
        bg, cg = (rearrange(v, "b t (g n) -> b t g n", g=g) for v in (b, c))
        y, ssm = ssd_scan(xh[:, :head], dt[:, :head], A, bg[:, :head], cg[:, :head], self.chunk_size, D=D, state=state)
        ys, trail = [y], []
        for i in range(head, x.shape[1]):
            trail.append(ssm)
            yi, ssm = ssd_step(ssm, xh[:, i], dt[:, i], A, bg[:, i], cg[:, i], D)
            ys.append(yi[:, None])
        return torch.cat(ys, dim=1), ssm, trail

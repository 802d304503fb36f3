"""RecurrentGemma's recurrent temporal block (Griffin): gated branch x conv1d -> RG-LRU branch, states in the cache.

Numerics follow HF's RecurrentGemma: gates and the sqrt(1 - a^2) input normalisation in the activations' dtype,
the scan in float32. The reset (a = 0, multiplier 1) happens where `step.positions == 0`, i.e. at a row's first
real token, so a left-padded row behaves exactly like the same prompt alone. Padding tokens are no-ops: their
conv inputs are zero and their LRU steps keep the state (a = 1, x = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.cache import CacheLayer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.mlp import activation
from hybridcache.ops import causal_conv1d, causal_conv1d_step, linear_recurrence


class RGLRU(nn.Module):
    """Real-Gated Linear Recurrent Unit with block-diagonal (per-head) input and recurrence gates."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"lru_width {width} must be divisible by num_attention_heads {num_heads}")
        self.num_heads, self.block_width = num_heads, width // num_heads
        bw = self.block_width
        self.recurrent_param = nn.Parameter(torch.zeros(width))
        self.input_gate_weight = nn.Parameter(torch.zeros(num_heads, bw, bw))
        self.input_gate_bias = nn.Parameter(torch.zeros(num_heads, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(num_heads, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(num_heads, bw))

    def _gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        xh = x.unflatten(-1, (self.num_heads, self.block_width))  # [B, T, H, bw]
        return torch.sigmoid(torch.einsum("bthi,hij->bthj", xh, weight) + bias).flatten(-2)  # [B, T, W]

    def coefficients(self, x: torch.Tensor, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Decay a [B, T, W] and normalised input [B, T, W] of h_t = a_t * h_{t-1} + x_t (padding: a=1, x=0)."""
        input_gate = self._gate(x, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self._gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)  # [B, T, W]
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        reset = (step.positions == 0)[..., None]  # [B, T, 1]: a row's first real token
        multiplier = torch.where(reset, torch.ones_like(a_square), torch.sqrt(1 - a_square))
        normalized = (x * input_gate) * multiplier.to(x.dtype)
        a = a.masked_fill(reset, 0.0)
        pad = ~step.valid[..., None]  # [B, T, 1]
        return a.masked_fill(pad, 1.0), normalized.masked_fill(pad, 0.0)

    def forward(self, x: torch.Tensor, state: torch.Tensor, step: StepInput, trail: int = 0):
        """x [B, T, W], state [B, W] -> (h [B, T, W] in x.dtype, final state [B, W] in the state's dtype).

        The scan runs in the state's dtype (float32 by default; float64 when the cache config asks for it).
        `trail=m > 0` also returns the states after each of the last m tokens before the final one [B, m, W]
        (the scan computes every token's state anyway: the same values, no extra work)."""
        a, normalized = self.coefficients(x, step)
        acc = torch.promote_types(state.dtype, torch.float32)
        if x.shape[1] == 1:  # decoding step
            h = torch.addcmul(normalized[:, 0].to(acc), a[:, 0].to(acc), state.to(acc))  # [B, W]
            return h[:, None].to(x.dtype), h.to(state.dtype)
        h, final = linear_recurrence(a.to(acc), normalized.to(acc), state.to(acc))
        if trail > 0:
            t = x.shape[1]
            return h.to(x.dtype), final.to(state.dtype), h[:, t - 1 - trail : t - 1].to(state.dtype)
        return h.to(x.dtype), final.to(state.dtype)


class RecurrentBlock(nn.Module):
    """linear_out(rg_lru(conv_1d(linear_x(h))) * act(linear_y(h))) with HF parameter names."""

    def __init__(
        self, hidden: int, lru_width: int, num_heads: int, conv_kernel: int, act: str = "gelu_pytorch_tanh"
    ) -> None:
        super().__init__()
        self.linear_y = nn.Linear(hidden, lru_width)
        self.linear_x = nn.Linear(hidden, lru_width)
        self.linear_out = nn.Linear(lru_width, hidden)
        self.conv_1d = nn.Conv1d(lru_width, lru_width, conv_kernel, groups=lru_width, padding=conv_kernel - 1)
        self.rg_lru = RGLRU(lru_width, num_heads)
        self.act = activation(act)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode step in one call), once installed
        if fast is not None:
            out = fast(h, layer, step)
            if out is not None:
                return out
        states = layer.states  # conv [B, W, K-1], lru [B, W]
        y = self.act(self.linear_y(h))  # [B, T, W]
        x = step.mask_padding(self.linear_x(h))  # [B, T, W], zero at padding
        weight, bias = self.conv_1d.weight[:, 0], self.conv_1d.bias  # [W, K], [W]
        if x.shape[1] == 1:
            xc, conv_state = causal_conv1d_step(x[:, 0], weight, bias, states["conv"])  # [B, W]
            xc = xc[:, None]
        else:
            xc, conv_state = causal_conv1d(x.transpose(1, 2), weight, bias, states["conv"])  # [B, W, T]
            xc = xc.transpose(1, 2)
        spec, m = layer.spec, layer.trail_length(x.shape[1])
        if m > 0:  # rollback on: the states after the block's last m tokens before the final one
            from hybridcache.nn.recurrent.trail import conv_trail

            out, lru_state, lru_trail = self.rg_lru(xc, states["lru"], step, trail=m)
            trail = {"conv": conv_trail(states["conv"], x.transpose(1, 2), m).to(spec.dtype), "lru": lru_trail}
            layer.update(conv=conv_state.to(spec.dtype), lru=lru_state.to(spec.state_dtype), trail=trail)
            return self.linear_out(out * y)
        out, lru_state = self.rg_lru(xc, states["lru"], step)  # [B, T, W], [B, W]
        layer.update(conv=conv_state.to(spec.dtype), lru=lru_state.to(spec.state_dtype))
        return self.linear_out(out * y)

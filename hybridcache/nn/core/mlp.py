"""Gated MLP: down(act(gate(x)) * up(x))."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.nn.core.linear import DecodeLinear
from hybridcache.nn.core.linear_group import LinearGroup
from hybridcache.ops import kernels


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (Nemotron-H)."""
    return F.relu(x).square()


# named functions, not lambdas: a module holding one pickles (torch.save(model), multiprocessing)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "relu": F.relu,
    "relu2": relu2,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}' (supported: {', '.join(ACTIVATIONS)})") from None


class GatedMLP(nn.Module):
    #: Whether `forward` is this class's (down(act(gate(x)) * up(x))), so a fused kernel may compute it instead: a
    #: subclass that defines its own forward says False for itself and its subclasses (set at class creation).
    computes_gated_mlp = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.computes_gated_mlp = cls.computes_gated_mlp and "forward" not in vars(cls)

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act, self.act_name = activation(act), act
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)  # one matmul once fused (from_pretrained)

    def projection_groups(self) -> list[LinearGroup]:
        return [self.gate_up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        kernel = self.act_name in kernels.ACTIVATIONS and kernels.takes(x) and x.dim() > 0
        parts = self.gate_up.parts() if kernel and isinstance(down, DecodeLinear) else None
        if parts is not None:  # a decode step on CPU: the whole MLP in one kernel call
            y = kernels.call("gated_mlp", x, *parts, down.weight, down.bias, down._buffers.get("scale"), self.act_name)
            if y is not None:
                return y
        gate_up = self.gate_up.joint(x)  # [..., 2I] once fused
        if gate_up is None:
            gate, up = self.gate_up(x)
        else:
            out = kernels.call("act_mul", gate_up, self.act_name) if kernel else None  # activation x product, one call
            if out is not None:
                return self.down_proj(out)
            gate, up = gate_up.split_with_sizes(self.gate_up.sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)

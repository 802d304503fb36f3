"""Several projections of the same input as one matmul (q/k/v, gate/up), with per-projection parameter names.

A decode step multiplies one row by many small matrices; on CPU each call costs dispatch time on top of reading
the weight, so q, k and v (or gate and up) read as one [sum(out), in] matrix save two calls per layer and give the
kernel one larger problem. `LinearGroup.fuse()` makes the projections' weights (and biases) row blocks of one
contiguous tensor: the parameters keep their names and shapes (state_dict, loading, tying are unchanged), no
memory is duplicated, and an in-place change of a parameter changes the fused tensor too. When something replaces
a parameter (e.g. `model.to(dtype)` before the model re-fuses), the group notices and runs the projections one by
one: never a stale weight. `pack(fmt)` stores the fused matrix in a packed format (nn/core/linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.linear import linear, pack_matrix


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    """module.<name> from `_parameters` where it is registered there (None included: no bias); nn.Module.__getattr__
    costs a call per access, six per decode-step layer here."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


class LinearGroup:
    """Callable on x [..., in]: the outputs of `linears` (a tuple), by one matmul once fused."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        # (weight [sum(out), in], bias, per-row scale (int8) or None, the members' parameter addresses)
        self._fused: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[int, ...]] | None = None

    def _pointers(self) -> tuple[int, ...]:
        out = []
        for lin in self.linears:
            for name in ("weight", "bias"):
                p = _param(lin, name)
                if p is not None:
                    out.append(p.data_ptr())
        return tuple(out)

    def _adopt(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """Make each member's parameters row blocks of `weight` / `bias` (and its scale buffer of `scale`)."""
        weights = weight.split(self.sizes)
        biases = bias.split(self.sizes) if bias is not None else [None] * len(self.linears)
        scales = scale.split(self.sizes) if scale is not None else [None] * len(self.linears)
        for lin, w, b, s in zip(self.linears, weights, biases, scales):
            lin.weight = nn.Parameter(w, requires_grad=w.is_floating_point() and lin.weight.requires_grad)
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
            lin._buffers["scale"] = s
        self._fused = (weight, bias, scale, self._pointers())

    def fuse(self) -> bool:
        """Make the weights (and biases) row blocks of one tensor; False (nothing changed) when they cannot be:
        different input sizes, dtypes or devices, some with a bias and some without, packed or meta weights."""
        if self.fused:  # already (and still) one tensor, packed or not
            return True
        ws = [lin.weight for lin in self.linears]
        biases = [lin.bias for lin in self.linears]
        if (
            len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1
            or len({b is None for b in biases}) != 1
            or ws[0].device.type == "meta"
            or any(lin._buffers.get("scale") is not None for lin in self.linears)
        ):
            self._fused = None
            return False
        with torch.no_grad():
            weight = torch.cat([w.detach() for w in ws])  # [sum(out), in]
            bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self._adopt(weight, bias, None)
        return True

    def pack(self, fmt: str) -> None:
        """Store the fused matrix in a packed format (nn/core/linear.py `pack_matrix`); the group must be fused."""
        if not self.fused:
            raise ValueError("pack() needs a fused group (call fuse() first)")
        weight, bias, _, _ = self._fused
        packed, scale = pack_matrix(weight, fmt)
        self._adopt(packed, bias, scale)

    @property
    def fused(self) -> bool:
        """Whether the projections run as one matmul (their parameters are still blocks of the fused tensor)."""
        return self._fused is not None and self._fused[3] == self._pointers()

    def parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """(weight [sum(out), in], bias, per-row scale) of the fused matrix; None when not fused (traced as `joint`:
        data pointers would break the graph)."""
        f = self._fused
        if f is not None and (torch.compiler.is_compiling() or f[3] == self._pointers()):
            return f[0], f[1], f[2]
        return None

    def joint(self, x: torch.Tensor) -> torch.Tensor | None:
        """The members' outputs side by side [..., sum(out)] by one matmul; None when not fused."""
        f = self._fused
        if f is not None and (torch.compiler.is_compiling() or f[3] == self._pointers()):
            return linear(x, f[0], f[1], f[2])
        return None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.joint(x)
        if out is not None:
            return out.split_with_sizes(self.sizes, dim=-1)
        return tuple(lin(x) for lin in self.linears)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every projection group of `model` (modules with `projection_groups()`); returns how many fused."""
    fused = 0
    for module in model.modules():
        groups = getattr(module, "projection_groups", None)
        if groups is not None:
            fused += sum(g.fuse() for g in groups())
    return fused

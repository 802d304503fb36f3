"""Rotary position embeddings: half-split ("rotate_half") or interleaved pairs, optionally on part of the head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridcache.ops import kernels


def rope_frequencies(
    hf_config: Mapping[str, Any], params: Mapping[str, Any], rotary_dim: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the cos/sin scaling for one `rope_parameters` entry.

    The default type is computed here; scaled types (linear, llama3, yarn, ...) use transformers' own
    initialisers so real checkpoints get exactly their reference frequencies.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base**exponents), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type '{rope_type}' (supported: default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    cfg = AutoConfig.for_model(**{**hf_config, "rope_parameters": dict(params)})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(scaling)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, R] float32 of positions [B, T] by inv_freq [R/2] (times `scaling`)."""
    angles = positions[..., None].float() * inv_freq  # [B, T, R/2]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)  # [B, T, R]: pairs (0, 1), (2, 3), ...
    else:
        angles = torch.cat([angles, angles], dim=-1)  # [B, T, R]: halves
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos[:, None].contiguous(), sin[:, None].contiguous()


# The tables as one opaque op under torch.compile on CPU: inductor's own sin / cos differ from ATen's by an ulp, which
# would make a compiled decode step differ from the eager one (that runs the same kernels on the same tables).
_LIBRARY = torch.library.Library("hybridcache", "FRAGMENT")
_LIBRARY.define("rope_tables(Tensor positions, Tensor inv_freq, float scaling, bool interleaved) -> (Tensor, Tensor)")
_LIBRARY.impl("rope_tables", rope_tables, "CPU")


@torch.library.register_fake("hybridcache::rope_tables", lib=_LIBRARY)
def _(positions, inv_freq, scaling, interleaved):
    shape = [*positions.shape, 2 * inv_freq.shape[0]]
    shape.insert(1, 1)  # (cos[:, None] above)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of q and k [B, H, T, D] by position.

    `forward(q, k, positions_or_step)` takes the block's positions [B, T], or the block itself (a `StepInput`):
    then cos/sin are computed once per block and frequency table, and every layer sharing this module reuses them.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, interleaved: bool = False) -> None:
        super().__init__()
        self.inv_freq = inv_freq.float()  # a plain attribute: model.to(bfloat16) must not round the frequencies
        self.scaling, self.interleaved = scaling, interleaved
        self.rotary_dim = 2 * inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if torch.compiler.is_compiling() and positions.device.type == "cpu":  # one opaque op: see rope_tables
            cos, sin = torch.ops.hybridcache.rope_tables(positions, self.inv_freq, self.scaling, self.interleaved)
        else:
            cos, sin = rope_tables(positions, self.inv_freq, self.scaling, self.interleaved)
        return cos.to(dtype), sin.to(dtype)  # [B, 1, T, R]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def tables(self, positions: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, R] for positions [B, T], or for a block (a `StepInput`): computed once per block and
        frequency table, and reused by every layer that shares this module."""
        if isinstance(positions, torch.Tensor):
            return self.cos_sin(positions, dtype)
        key = (id(self), dtype)
        cs = positions.memo.get(key)
        if cs is None:
            cs = positions.memo[key] = self.cos_sin(positions.rope_positions, dtype)
        return cs

    def mean_rotation(self, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
        """R [D, D] with R @ x = the mean over `positions` [N] of x rotated to each (ExpectedAttention's average
        rotary matrix), built by rotating the identity's rows: partial and interleaved layouts included."""
        basis = torch.eye(head_dim, dtype=torch.float64)[None, None].expand(positions.numel(), 1, head_dim, head_dim)
        cos, sin = self.cos_sin(positions.reshape(-1, 1).to(self.inv_freq.device), torch.float64)  # [N, 1, 1, R]
        r = self.rotary_dim
        rot, rest = basis[..., :r], basis[..., r:]
        rotated = torch.cat([rot * cos + self._rotate(rot) * sin, rest], dim=-1)  # row j: rotation of e_j
        return rotated.mean(0)[0].T

    def kernel_tables(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether x [B, H, T, D] rotates by the rotary kernels with these tables (float32, one row per batch row:
        what the ops' declared rules take)."""
        return kernels.takes(x) and cos.dtype == torch.float32 and cos.dim() == 4 and cos.shape[0] == x.shape[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, T, D] and k [B, Hkv, T, D] rotated by cos/sin [B (or 1), 1, T, R] of `positions`; tables of any
        other shape (positions that are not [B, T], say) are refused rather than broadcast into a wrong result."""
        cos, sin = self.tables(positions, q.dtype)
        r = self.rotary_dim
        if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or r > q.shape[-1]:
            raise ValueError(
                f"rotary: q and k must be [B, H, T, D] with the same B and T and D >= {r}, got "
                f"{tuple(q.shape)} and {tuple(k.shape)}"
            )
        want = (q.shape[0], 1, q.shape[2], r)
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 4 or table.shape[0] not in (1, want[0]) or tuple(table.shape[1:]) != want[1:]:
                raise ValueError(
                    f"rotary: {name} has shape {tuple(table.shape)}, q {tuple(q.shape)} needs {want} "
                    "(positions must be [B, T], one per query token)"
                )
        if self.kernel_tables(q, cos) and k.dtype == torch.float32:  # one kernel call per tensor, any layout
            rq, rk = (
                kernels.call("rope", q, cos, sin, self.interleaved),
                kernels.call("rope", k, cos, sin, self.interleaved),
            )
            if rq is not None and rk is not None:
                return rq, rk

        def apply(x: torch.Tensor) -> torch.Tensor:
            if r == x.shape[-1]:
                return x * cos + self._rotate(x) * sin
            rot, rest = x[..., :r], x[..., r:]
            return torch.cat([rot * cos + self._rotate(rot) * sin, rest], dim=-1)

        return apply(q), apply(k)

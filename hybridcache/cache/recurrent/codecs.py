"""How recurrent cache layers hold their states between blocks: a codec per state format (`state_codec`).

The mixer always sees and hands back states in the spec's `state_dtype` (float32 by default); the codec decides what
is held in between. Every block re-encodes: the mixer reads the decoded state, computes in its own precision, and the
new state is stored encoded, so a lossy format's error enters once per block and accumulates over a generation.

    dense                  the state_dtype as is (default; exact)
    float32 / bfloat16 / float16   a cast (float32 is exact for float32 and lower state dtypes; float16 overflows
                           past 65504)
    float8_e4m3fn / float8_e5m2    fp8 values times a float32 scale per group (absmax maps to the format's max)
    int8 / int4            symmetric absmax integers (127 / 7 levels) times a float32 scale per group; int4 packs two
                           values per byte (low nibble first) over the state flattened per row
    zero                   nothing: the state is dropped after every block (the next block starts from zeros). Not
                           a format but the control of a study: what the model loses without that state

Groups (`state_group`): `channel` gives one scale per vector along the state's last axis (mamba2 ssm [H, P, N]:
scales [H, P]); `head` one per index of its first axis (mamba2 / gated_delta: per head; mamba [D, N] and conv
[C, K-1]: per channel, as `channel`). A 1-d state (rglru's [W]) gets one scale per row either way. Error per element:
int <= scale / 2; fp8 <= half an fp8 step of x / scale, times scale. A new format is one class:
`@register_state_codec("name")`.

Rounding (`rounding`, see docs/state_drift.md): `nearest` (default) rounds to the nearest code; `stochastic` rounds
down or up at random with the probability that makes the expected code equal the value (floor(y + u), u ~ U[0, 1),
in units of the grid step there), so the error has mean zero and the per-element error stays below one step. A codec
takes the uniforms as `encode(x, shape, noise)`; the layout draws them (state_layout.py: seeded per cache, keyed by
the column, so a rewound or restored cache draws the same ones again).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch

from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.storage.codecs import registrar

Shape = tuple[int, ...]
Fields = dict[str, tuple[Shape, torch.dtype]]  # part name ("" for a single part) -> (shape per row, dtype)
GROUPS = ("channel", "head")
ROUNDINGS = ("nearest", "stochastic")
SCALE_DTYPE = torch.float32


def float_grid_step(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s finite values at each |y| (a power of two): 2^floor(log2|y|) * eps for normal
    magnitudes, the subnormal step below; computed in y's dtype (float32 or wider)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(y)  # |y| = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(y), exponent - 1).clamp(min=info.smallest_normal) * info.eps


def stochastic_round(y: torch.Tensor, step: torch.Tensor | float, noise: torch.Tensor) -> torch.Tensor:
    """floor(y / step + u) * step: one of the two grid points around y, the upper one with probability equal to the
    fraction of the step y is past the lower one, so E[result] = y."""
    return torch.floor(y / step + noise.to(y.dtype)) * step


def round_to_float(y: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor | None) -> torch.Tensor:
    """y cast to `dtype`: to nearest (noise None) or stochastically onto its grid (finite values stay finite where
    the nearest cast keeps them: a draw past the largest value is clamped to it; beyond it, the nearest cast)."""
    if noise is None:
        return y.to(dtype)
    top = torch.finfo(dtype).max
    rounded = stochastic_round(y, float_grid_step(y, dtype), noise).clamp(-top, top)
    return torch.where(y.abs() > top, y, rounded).to(dtype)


class StateCodec(ABC):
    """A storage format for one state tensor of shape `shape` (without batch) whose mixer-side dtype is `dtype`."""

    name: ClassVar[str] = "?"
    rounds: ClassVar[bool] = True  # whether encode rounds (so `rounding: stochastic` means something)

    def __init__(self, group: str = "channel") -> None:
        if group not in GROUPS:
            raise CacheConfigError(f"state_group must be one of {', '.join(GROUPS)}, got {group!r}")
        self.group = group

    def exact_for(self, dtype: torch.dtype) -> bool:
        """Whether states of `dtype` come back bit for bit."""
        return False

    @abstractmethod
    def fields(self, shape: Shape, dtype: torch.dtype) -> Fields:
        """The parts held per row, e.g. {"": (shape, dtype)} for dense storage."""

    @abstractmethod
    def encode(self, x: torch.Tensor, shape: Shape, noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """x [B, *lead, *shape] -> parts [B, *lead, *part shape] (lead: e.g. the checkpoint axis of a trail).
        `noise`: uniforms in [0, 1) broadcastable to x ([*lead, *shape], shared by the rows) for stochastic
        rounding; None rounds to nearest."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Parts [B, *lead, ...] -> x [B, *lead, *shape] in `dtype`."""

    def row_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        fields = self.fields(shape, dtype).values()
        return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in fields)


_CODECS: dict[str, type[StateCodec]] = {}
C = TypeVar("C", bound=type[StateCodec])
_register = registrar(_CODECS, StateCodec, "state codec", "register_state_codec", "state_codec")


def register_state_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a `StateCodec` available as `state_codec: <name>` in cache configs."""
    return _register(name)


def available_state_codecs() -> list[str]:
    return sorted(_CODECS)


def get_state_codec(name: str, group: str = "channel") -> StateCodec:
    if not isinstance(name, str) or name not in _CODECS:
        raise CacheConfigError(f"unknown state_codec {name!r}; known: {', '.join(available_state_codecs())}")
    return _CODECS[name](group)


@register_state_codec("dense")
class DenseStateCodec(StateCodec):
    """The state in its own dtype."""

    rounds = False

    def exact_for(self, dtype):
        return True

    def fields(self, shape, dtype):
        return {"": (shape, dtype)}

    def encode(self, x, shape, noise=None):
        return {"": x}

    def decode(self, parts, shape, dtype):
        return parts[""]


@register_state_codec("zero")
class ZeroStateCodec(StateCodec):
    """The ablation: holds nothing (a [B, *lead, 0] placeholder keeps the row count), decodes to zeros."""

    rounds = False

    def fields(self, shape, dtype):
        return {"": ((0,), dtype)}

    def encode(self, x, shape, noise=None):
        return {"": x.new_zeros((*x.shape[: x.dim() - len(shape)], 0))}

    def decode(self, parts, shape, dtype):
        held = parts[""]
        return held.new_zeros((*held.shape[:-1], *shape), dtype=dtype)


class CastStateCodec(StateCodec):
    """The state cast to `storage_dtype` (to nearest, or stochastically onto its grid)."""

    storage_dtype: ClassVar[torch.dtype]
    holds: ClassVar[tuple[torch.dtype, ...]] = ()  # state dtypes it represents exactly

    def exact_for(self, dtype):
        return dtype == self.storage_dtype or dtype in self.holds

    def fields(self, shape, dtype):
        return {"": (shape, self.storage_dtype)}

    def encode(self, x, shape, noise=None):
        if noise is None:
            return {"": x.to(self.storage_dtype)}
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        return {"": round_to_float(work, self.storage_dtype, noise)}

    def decode(self, parts, shape, dtype):
        return parts[""].to(dtype)


@register_state_codec("float32")
class Float32StateCodec(CastStateCodec):
    storage_dtype = torch.float32
    holds = (torch.bfloat16, torch.float16)


@register_state_codec("bfloat16")
class BFloat16StateCodec(CastStateCodec):
    storage_dtype = torch.bfloat16


@register_state_codec("float16")
class Float16StateCodec(CastStateCodec):
    storage_dtype = torch.float16


class ScaledStateCodec(StateCodec):
    """Values / scale in a narrow format, with one float32 scale per group (see `scale_shape`)."""

    def scale_shape(self, shape: Shape) -> Shape:
        """[*shape[:-1]] for `channel`, [shape[0]] for `head`, [] (one per row) for a 1-d state."""
        if len(shape) <= 1:
            return ()
        return shape[:-1] if self.group == "channel" else shape[:1]

    def _grouped(self, x: torch.Tensor, shape: Shape) -> torch.Tensor:
        """x [.., *shape] -> [.., *scale_shape, elements per scale]."""
        return x.flatten(x.dim() - len(shape) + len(self.scale_shape(shape)))

    def scales(self, x: torch.Tensor, shape: Shape, top: float) -> torch.Tensor:
        """Float32 scales [.., *scale_shape] mapping each group's absmax to `top`."""
        amax = self._grouped(x, shape).abs().amax(-1).to(SCALE_DTYPE)
        return (amax / top).clamp(min=torch.finfo(SCALE_DTYPE).tiny)

    def scaled(self, x: torch.Tensor, shape: Shape, scale: torch.Tensor) -> torch.Tensor:
        """x / scale [.., *scale_shape, group] in float32 or wider."""
        work = x.to(torch.promote_types(x.dtype, SCALE_DTYPE))
        return self._grouped(work, shape) / scale.to(work.dtype)[..., None]

    def ungrouped(self, t: torch.Tensor, shape: Shape) -> torch.Tensor:
        """[.., *scale_shape, group] -> [.., *shape] (the inverse of `_grouped`)."""
        return t.flatten(t.dim() - len(self.scale_shape(shape)) - 1).unflatten(-1, shape)

    def unscaled(self, values: torch.Tensor, scale: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """values [.., *scale_shape, group] * scale -> [.., *shape] in `dtype`."""
        return self.ungrouped(values.to(SCALE_DTYPE) * scale[..., None], shape).to(dtype)


class IntStateCodec(ScaledStateCodec):
    """Symmetric absmax integers in [-levels, levels]: q = round(x / scale) (stochastic: floor(x / scale + u)),
    scale = absmax / levels."""

    levels: ClassVar[int] = 127

    def fields(self, shape, dtype):
        return {"q": (shape, torch.int8), "scale": (self.scale_shape(shape), SCALE_DTYPE)}

    def quantize(
        self, x: torch.Tensor, shape: Shape, noise: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scales(x, shape, self.levels)
        y = self.scaled(x, shape, scale)  # [.., *scale_shape, group]
        q = torch.round(y) if noise is None else stochastic_round(y, 1.0, self._grouped(noise, shape))
        q = q.clamp(-self.levels, self.levels)
        return self.ungrouped(q, shape).to(torch.int8), scale  # [.., *shape], [.., *scale_shape]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        return self.unscaled(self._grouped(q, shape), scale, shape, dtype)

    def encode(self, x, shape, noise=None):
        q, scale = self.quantize(x, shape, noise)
        return {"q": q, "scale": scale}

    def decode(self, parts, shape, dtype):
        return self.dequantize(parts["q"], parts["scale"], shape, dtype)


@register_state_codec("int8")
class Int8StateCodec(IntStateCodec):
    levels = 127


@register_state_codec("int4")
class Int4StateCodec(IntStateCodec):
    """4-bit integers in [-7, 7], two per byte over the row's flattened state (a trailing odd value pads to a byte)."""

    levels = 7

    def fields(self, shape, dtype):
        return {"q": (((math.prod(shape) + 1) // 2,), torch.uint8), "scale": (self.scale_shape(shape), SCALE_DTYPE)}

    def encode(self, x, shape, noise=None):
        q, scale = self.quantize(x, shape, noise)
        flat = (q.flatten(q.dim() - len(shape)) + 8).to(torch.uint8)  # [.., n] in [1, 15]
        if flat.shape[-1] % 2:
            flat = torch.nn.functional.pad(flat, (0, 1), value=8)
        pairs = flat.unflatten(-1, (-1, 2))
        return {"q": pairs[..., 0] | (pairs[..., 1] << 4), "scale": scale}

    def decode(self, parts, shape, dtype):
        packed = parts["q"]
        flat = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., : math.prod(shape)]
        q = (flat.to(torch.int8) - 8).unflatten(-1, shape)
        return self.dequantize(q, parts["scale"], shape, dtype)


class Fp8StateCodec(ScaledStateCodec):
    """fp8 values of x / scale, scale = absmax / the format's largest finite value (saturating, so never NaN)."""

    fp8: ClassVar[torch.dtype]

    def fields(self, shape, dtype):
        return {"q": (shape, self.fp8), "scale": (self.scale_shape(shape), SCALE_DTYPE)}

    def encode(self, x, shape, noise=None):
        top = torch.finfo(self.fp8).max
        scale = self.scales(x, shape, top)
        values = self.scaled(x, shape, scale).clamp(-top, top)  # [.., *scale_shape, group]
        values = round_to_float(values, self.fp8, None if noise is None else self._grouped(noise, shape))
        return {"q": self.ungrouped(values, shape), "scale": scale}

    def decode(self, parts, shape, dtype):
        return self.unscaled(self._grouped(parts["q"], shape), parts["scale"], shape, dtype)


for _name in ("float8_e4m3fn", "float8_e5m2"):  # where this torch has them
    if isinstance(getattr(torch, _name, None), torch.dtype):
        register_state_codec(_name)(
            type(
                f"Fp8{_name[7:].upper()}StateCodec",
                (Fp8StateCodec,),
                {"fp8": getattr(torch, _name), "__module__": __name__},
            )
        )

"""Where a recurrent cache layer's states are held: each named state encoded by its codec into stored parts.

A state `ssm` held by a one-part codec (dense, float casts) is the attribute `ssm`, as before codecs existed (so
saved caches and code reading `layer.ssm` keep working); a multi-part codec gives `ssm_q` and `ssm_scale`. With
`rollback: k` each part has its trail `<attr>_trail` [B, k, ...]. The conv state (the last K-1 conv inputs) is
held dense unless the spec sets `quantize_conv` (see recurrent.py for why).

The two remedies for drift under re-encoding (docs/state_drift.md):
- `rounding: stochastic`: the codec rounds with uniforms drawn here. They are a pure function of (rounding_seed, the
  layer's index in its Cache, the state's name, the column the state is taken after, the element), shared by the
  rows: a torch.Generator seeded per draw by a 64-bit hash of the first four (a counter-based scheme, as the Philox
  streams of the serving kernels). So a cache rewound by crop, restored from a snapshot or loaded from a file draws
  exactly the uniforms the original would have, and batch operations commute with decoding.
- `error_feedback: true`: each lossy state keeps its quantization residual r as one more held part (`<name>_residual`,
  or `<name>_residual_q` / `_scale` for a scaled `error_codec`), trailed, snapshotted, saved and moved with the
  rows like every part. An encode holds encode(x + r) and keeps r' = x + r - decode(encode(x + r)) (held in
  `error_codec`: `dense`, the state's dtype, by default); the mixer still reads decode(encode(x + r)).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from hybridcache.cache.recurrent.codecs import DenseStateCodec, StateCodec, get_state_codec

Shape = tuple[int, ...]
Parts = dict[str, tuple[str, Shape, torch.dtype]]  # part -> (attribute, shape per row, dtype)


def noise_seed(seed: int, stream: int, name: str, column: int) -> int:
    """The generator seed of one draw: a 63-bit hash of what identifies it (stable across runs and machines)."""
    digest = hashlib.blake2b(f"{seed}:{stream}:{name}:{column}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class StateLayout:
    """The codec and stored parts of every state of a recurrent spec."""

    def __init__(self, spec: Any) -> None:
        codec = get_state_codec(spec.state_codec, spec.state_group)
        self.shapes: dict[str, tuple[Shape, torch.dtype]] = spec.state_shapes()
        self.codecs: dict[str, StateCodec] = {
            name: DenseStateCodec() if name == "conv" and not spec.quantize_conv else codec for name in self.shapes
        }
        self.stochastic = getattr(spec, "rounding", "nearest") == "stochastic"
        self.seed = int(getattr(spec, "rounding_seed", 0))
        residual = None
        if getattr(spec, "error_feedback", False):
            residual = get_state_codec(getattr(spec, "error_codec", None) or "dense", spec.state_group)
        # error feedback only where the codec loses something: an exactly held state has no residual to keep
        self.error_codecs: dict[str, StateCodec] = {
            name: residual
            for name, (_, dtype) in self.shapes.items()
            if residual is not None and not self.codecs[name].exact_for(dtype)
        }
        self.parts: dict[str, Parts] = {}  # state -> its code parts
        self.residual_parts: dict[str, Parts] = {}  # state -> its residual's parts (error feedback)
        for name, (shape, dtype) in self.shapes.items():
            self.parts[name] = self._parts(self.codecs[name], name, shape, dtype)
            if name in self.error_codecs:
                self.residual_parts[name] = self._parts(self.error_codecs[name], f"{name}_residual", shape, dtype)

    @staticmethod
    def _parts(codec: StateCodec, prefix: str, shape: Shape, dtype: torch.dtype) -> Parts:
        fields = codec.fields(shape, dtype)
        return {part: (f"{prefix}_{part}" if part else prefix, s, dt) for part, (s, dt) in fields.items()}

    def _all_parts(self) -> list[tuple[str, Shape, torch.dtype]]:
        out = []
        for name in self.shapes:
            out += list(self.parts[name].values()) + list(self.residual_parts.get(name, {}).values())
        return out

    @property
    def attrs(self) -> tuple[str, ...]:
        """Every stored attribute (without trails), in state order, each state's residual after its codes."""
        return tuple(attr for attr, _, _ in self._all_parts())

    @property
    def exact(self) -> bool:
        return all(self.codecs[n].exact_for(dt) for n, (_, dt) in self.shapes.items())

    @property
    def feedback(self) -> bool:
        """Whether some state keeps a residual (encode then needs the held parts)."""
        return bool(self.error_codecs)

    def row_nbytes(self) -> int:
        """Bytes held per row for one copy of every state (codes + scales + error-feedback residuals)."""
        total = 0
        for name, (shape, dtype) in self.shapes.items():
            total += self.codecs[name].row_nbytes(shape, dtype)
            if name in self.error_codecs:
                total += self.error_codecs[name].row_nbytes(shape, dtype)
        return total

    def allocate(self, batch: int, lead: Shape, device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed parts [batch, *lead, ...] by attribute (zero codes and scales decode to zero states and residuals)."""
        parts = self._all_parts()
        return {attr: torch.zeros((batch, *lead, *shape), dtype=dt, device=device) for attr, shape, dt in parts}

    def noise(self, name: str, columns: int | Sequence[int], stream: int, device: torch.device) -> torch.Tensor:
        """Uniforms in [0, 1) for the state `name` taken after `columns` ([*shape]; [m, *shape] for m columns)."""
        shape = self.shapes[name][0]
        draws = []
        for column in [columns] if isinstance(columns, int) else columns:
            g = torch.Generator(device=device).manual_seed(noise_seed(self.seed, stream, name, int(column)))
            draws.append(torch.rand(shape, generator=g, device=device))
        return draws[0] if isinstance(columns, int) else torch.stack(draws)

    def encode(
        self,
        states: dict[str, torch.Tensor],
        held: dict[str, torch.Tensor] | None = None,
        columns: int | Sequence[int] | None = None,
        stream: int = 0,
    ) -> dict[str, torch.Tensor]:
        """States [B, *lead, *shape] by name -> parts [B, *lead, ...] by attribute. `held`: the parts held before
        (their residuals are fed back; None: zero residuals); `columns`: the column each state is taken after (one
        per lead index for a trail), keying the uniforms of stochastic rounding (None: round to nearest);
        `stream`: the layer's index in its Cache."""
        out = {}
        for name, x in states.items():
            shape, codec = self.shapes[name][0], self.codecs[name]
            draw = self.stochastic and codec.rounds and columns is not None
            noise = self.noise(name, columns, stream, x.device) if draw else None
            if name not in self.error_codecs:
                self._put(out, self.parts[name], codec.encode(x, shape, noise))
                continue
            r = self.decode_residual(held, name) if held is not None else x.new_zeros((x.shape[0], *shape))
            lead = x.dim() - 1 - len(shape)
            target = x + r.reshape(r.shape[0], *([1] * lead), *shape)  # the residual of the state before, fed back
            encoded = codec.encode(target, shape, noise)
            self._put(out, self.parts[name], encoded)
            left = target - codec.decode(encoded, shape, x.dtype)
            self._put(out, self.residual_parts[name], self.error_codecs[name].encode(left, shape))
        return out

    @staticmethod
    def _put(out: dict[str, torch.Tensor], parts: Parts, encoded: dict[str, torch.Tensor]) -> None:
        out.update({attr: encoded[part] for part, (attr, _, _) in parts.items()})

    def decode(self, held: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The state `name` [B, *lead, *shape] in its dtype from the parts by attribute."""
        shape, dtype = self.shapes[name]
        parts = {part: held[attr] for part, (attr, _, _) in self.parts[name].items()}
        return self.codecs[name].decode(parts, shape, dtype)

    def decode_residual(self, held: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The error-feedback residual of state `name` [B, *lead, *shape] in the state's dtype."""
        shape, dtype = self.shapes[name]
        parts = {part: held[attr] for part, (attr, _, _) in self.residual_parts[name].items()}
        return self.error_codecs[name].decode(parts, shape, dtype)

    def round_trip(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """decode(encode(x)) to nearest with a zero residual: what a layer without the remedies gives back after
        being handed `states`, bit for bit (with them, what it holds also depends on its residual and column)."""
        held = self.encode(states)
        return {name: self.decode(held, name) for name in states}

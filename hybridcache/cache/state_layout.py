"""Where a recurrent cache layer's states are held: each named state encoded by its codec into stored parts.

A state `ssm` held by a one-part codec (dense, float casts) is the attribute `ssm`, as before codecs existed (so
saved caches and code reading `layer.ssm` keep working); a multi-part codec gives `ssm_q` and `ssm_scale`. With
`checkpoints: k` each part has its trail `<attr>_trail` [B, k, ...]. The conv state (the last K-1 conv inputs) is
held dense unless the spec sets `quantize_conv` (see recurrent.py for why).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.state_codecs import DenseStateCodec, StateCodec, get_state_codec

Shape = tuple[int, ...]


class StateLayout:
    """The codec and stored parts of every state of a recurrent spec."""

    def __init__(self, spec: Any) -> None:
        codec = get_state_codec(spec.state_codec, spec.state_group)
        self.shapes: dict[str, tuple[Shape, torch.dtype]] = spec.state_shapes()
        self.codecs: dict[str, StateCodec] = {
            name: DenseStateCodec() if name == "conv" and not spec.quantize_conv else codec for name in self.shapes
        }
        self.parts: dict[str, dict[str, tuple[str, Shape, torch.dtype]]] = {}  # state -> part -> (attr, shape, dtype)
        for name, (shape, dtype) in self.shapes.items():
            fields = self.codecs[name].fields(shape, dtype)
            self.parts[name] = {part: (f"{name}_{part}" if part else name, s, dt) for part, (s, dt) in fields.items()}

    @property
    def attrs(self) -> tuple[str, ...]:
        """Every stored attribute (without trails), in state order."""
        return tuple(attr for parts in self.parts.values() for attr, _, _ in parts.values())

    @property
    def exact(self) -> bool:
        return all(self.codecs[n].exact_for(dt) for n, (_, dt) in self.shapes.items())

    def row_nbytes(self) -> int:
        """Bytes held per row for one copy of every state (codes + scales)."""
        return sum(self.codecs[n].row_nbytes(shape, dt) for n, (shape, dt) in self.shapes.items())

    def allocate(self, batch: int, lead: Shape, device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed parts [batch, *lead, ...] by attribute (zero codes and scales decode to zero states)."""
        return {
            attr: torch.zeros((batch, *lead, *shape), dtype=dt, device=device)
            for parts in self.parts.values()
            for attr, shape, dt in parts.values()
        }

    def encode(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """States [B, *lead, *shape] by name -> parts [B, *lead, ...] by attribute."""
        out = {}
        for name, x in states.items():
            encoded = self.codecs[name].encode(x, self.shapes[name][0])
            out.update({attr: encoded[part] for part, (attr, _, _) in self.parts[name].items()})
        return out

    def decode(self, held: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The state `name` [B, *lead, *shape] in its dtype from the parts by attribute."""
        shape, dtype = self.shapes[name]
        parts = {part: held[attr] for part, (attr, _, _) in self.parts[name].items()}
        return self.codecs[name].decode(parts, shape, dtype)

    def round_trip(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the layer gives back after being handed `states`: decode(encode(x)), bit for bit."""
        held = self.encode(states)
        return {name: self.decode(held, name) for name in states}

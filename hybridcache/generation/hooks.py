"""What the generation loop calls each step besides the model: stopping criteria and streamers (HF's conventions).

- A stopping criterion is any callable `(input_ids [B, T], scores [B, V]) -> BoolTensor [B]` (or a bool for every
  row): True marks a row finished after the token just chosen; a finished row is padded from then on, and the loop
  ends when every row is finished. eos is one such criterion (`EosCriteria`).
- A streamer has `put(tokens [B])`, called once per step with the tokens chosen (padding after a finished row), and
  `end()`, called once after the last step; a plain callable is wrapped as `CallbackStreamer(fn)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridcache.models.core.base import GenerationError, GenerationTypeError

StoppingCriterion = Callable[[torch.Tensor, torch.Tensor], Any]


class EosCriteria:
    """Rows whose last token is one of the eos ids."""

    def __init__(self, eos: torch.Tensor) -> None:
        self.eos = eos  # [E] long

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.isin(input_ids[:, -1], self.eos)


class StoppingCriteriaList:
    """The criteria of one generation, or-ed per row."""

    def __init__(self, criteria: Iterable[StoppingCriterion] = ()) -> None:
        self.criteria = list(criteria)
        for c in self.criteria:
            if not callable(c):
                raise GenerationTypeError(f"a stopping criterion must be callable, got {type(c).__name__}")

    def __bool__(self) -> bool:
        return bool(self.criteria)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """BoolTensor [B]: the rows any criterion finishes."""
        batch = input_ids.shape[0]
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for c in self.criteria:
            got = c(input_ids, scores)
            if isinstance(got, bool):
                got = torch.full((batch,), got, dtype=torch.bool, device=input_ids.device)
            if not isinstance(got, torch.Tensor) or got.shape != (batch,):
                raise GenerationError(
                    f"a stopping criterion must return a bool or a BoolTensor [{batch}], {c!r} returned {got!r}"
                )
            done |= got.to(device=done.device, dtype=torch.bool)
        return done


class BaseStreamer:
    """Receives the generated tokens as they are chosen (HF's BaseStreamer: put, end)."""

    def put(self, tokens: torch.Tensor) -> None:  # [B]
        raise NotImplementedError

    def end(self) -> None:
        pass


class CallbackStreamer(BaseStreamer):
    """`fn(tokens [B])` once per step."""

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        self.fn = fn

    def put(self, tokens: torch.Tensor) -> None:
        self.fn(tokens)


def as_streamer(streamer: Any) -> BaseStreamer | None:
    """None, a streamer (put/end) or a callable (wrapped); anything else is a named error."""
    if streamer is None or (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        return streamer
    if callable(streamer):
        return CallbackStreamer(streamer)
    raise GenerationTypeError(
        f"streamer must have put(tokens) and end(), or be a callable fn(tokens), got {type(streamer).__name__}"
    )

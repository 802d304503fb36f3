"""Choosing the next token: logits processors (HF's `LogitsProcessor` convention), greedy and sampling.

Below every generation path (generation/loop.py's loop and the token sources: generation/sources/cached.py,
generation/sources/speculative.py,
generation/sources/beam.py), so none of them imports another for these helpers. A processor is any callable
`(input_ids [B, T], scores [B, V]) -> scores [B, V]`, as in Hugging Face: the user's processors run first, then
the sampler (greedy, or temperature / top-k / top-p sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridcache.accel.native.kernels import argmax_rows
from hybridcache.models.core.base import GenerationError

# The smallest temperature: the smallest normal float32. Logits are sampled in float32 and shifted by their row's
# maximum before dividing by T (sample_next), so no T from here up overflows; below it T itself rounds to 0 in float32.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """Named errors for a temperature, top_k or top_p no sampler can use."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature > 0
        or temperature == float("inf")
    ):
        raise GenerationError(f"temperature must be a finite number > 0, got {temperature!r}")
    if temperature < MIN_TEMPERATURE:
        raise GenerationError(
            f"temperature must be >= {MIN_TEMPERATURE:.4g} (the smallest normal float32: logits "
            f"are sampled in float32), got {temperature!r}; for the most likely token use "
            "do_sample=False"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise GenerationError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise GenerationError(f"top_p must be in (0, 1], got {top_p!r}")


def eos_ids(eos_token_id: Any, vocab_size: int) -> list[int]:
    """eos_token_id (None, an id or a list of ids) as a list of ids in [0, vocab_size)."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if ids is None:
        return []
    if (
        not isinstance(ids, (list, tuple))
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or not all(0 <= i < vocab_size for i in ids)
    ):
        raise GenerationError(
            f"eos_token_id must be None, a token id or a list of token ids in [0, {vocab_size}), got {eos_token_id!r}"
        )
    return list(ids)


def pad_token(model_config: Any, pad_token_id: int | None, eos: torch.Tensor) -> int:
    """The id written after a row's eos: `pad_token_id`, else the model's, else the first eos id, else 0."""
    pad = pad_token_id if pad_token_id is not None else model_config.get("pad_token_id")
    return int(eos[0]) if pad is None and eos.numel() else int(pad or 0)


def check_finite(top: torch.Tensor, where: str = "", blocked: bool = True) -> None:
    """GenerationError where a row's largest score `top` [B] is NaN (some score is: max and argmax propagate it), +inf
    or, with `blocked`, -inf (every token is -inf: none can be chosen); any other -inf is a masked token. A
    model's non-finite logits (weights loaded with allow_nonfinite=True, an overflow in a low precision) have no
    next token: greedy would take the first NaN's index (token 0 for an all-NaN row), sampling fails in torch."""
    if bool(torch.isfinite(top).all()):  # the hot path: one reduction over [B]
        return
    bad = ~torch.isfinite(top) if blocked else torch.isnan(top) | (top == float("inf"))
    if not bool(bad.any()):
        return
    rows = bad.nonzero()[:, 0].tolist()
    v = float(top[rows[0]])
    kind = "NaN" if v != v else ("+inf" if v > 0 else "-inf for every token")
    which = f"row {rows[0]}" + (f" (and {len(rows) - 1} more)" if len(rows) > 1 else "")
    raise GenerationError(
        f"{where}the logits are not finite ({which}: {kind}): the model's output has no next token (weights "
        "loaded with allow_nonfinite=True, or an overflow in this dtype?); a logits processor that replaces them "
        "(e.g. transformers' InfNanRemoveLogitsProcessor) lets generation go on"
    )


def greedy_next(logits: torch.Tensor, where: str | None = None) -> torch.Tensor:
    """logits [B, V].argmax(-1): by the CPU kernel for float32 (torch's answer, ~20x faster on a 262k vocabulary,
    where torch's argmax takes 2% of a decode step), by torch otherwise. With `where` (the error's prefix), a
    GenerationError where a row's chosen score is not finite (check_finite: O(B), the argmax found it); None
    checks nothing (a draft's proposal, which the target verifies)."""
    out = argmax_rows(logits)
    out = out if out is not None else logits.argmax(-1)
    if where is not None:
        check_finite(logits.gather(-1, out[:, None])[:, 0], where)
    return out


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, where: str = ""
) -> torch.Tensor:
    """The distribution [..., V] `sample_next` draws from: logits [..., V] after temperature, top-k and top-p
    filtering, softmaxed in float32 (GenerationError first where a row is not finite: check_finite). Speculative
    sampling accepts and resamples against it."""
    scores = logits.float()
    top = scores.amax(-1, keepdim=True)  # [..., 1]
    check_finite(top[..., 0].reshape(-1), where)
    if temperature < 1:  # dividing amplifies: shift each row's maximum to 0 first, so no score overflows to +inf
        scores = scores - top
    scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(-1)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    where: str = "",
) -> torch.Tensor:
    """One token per row [B] from logits [B, V] after temperature, top-k and top-p filtering (sampling_probs)."""
    probs = sampling_probs(logits, temperature, top_k, top_p, where)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TokenChooser:
    """The processor / sampler chain: `chooser(input_ids [B, T], logits [B, V]) -> token [B]`."""

    def __init__(
        self,
        processors: Iterable[LogitsProcessor] = (),
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.processors = list(processors)
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.generator = generator
        self.steps = 0  # logits chosen from so far (the step an error names; greedy decode runs choose their own)

    def process(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The logits after every processor, in order."""
        for processor in self.processors:
            logits = processor(input_ids, logits)
            if not isinstance(logits, torch.Tensor):
                raise GenerationError(
                    f"a logits processor must return a tensor [B, V], {processor!r} returned {type(logits).__name__}"
                )
        return logits

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scores = self.process(input_ids, logits)
        self.steps += 1
        where = f"generation step {self.steps}: "
        if self.do_sample:
            return sample_next(scores, self.temperature, self.top_k, self.top_p, self.generator, where)
        return greedy_next(scores, where)

    def bind(self, history: Callable[[], torch.Tensor]) -> BoundChooser:
        """This chooser reading the tokens so far from `history()` (what a token source is handed)."""
        return BoundChooser(self, history)


class BoundChooser:
    """A chooser bound to the loop's tokens: `choose(logits [B, V]) -> token [B]`; `process` for a source that picks
    tokens itself (beam search scores the processed log-probabilities)."""

    def __init__(self, chooser: TokenChooser, history: Callable[[], torch.Tensor]) -> None:
        self.chooser, self.history = chooser, history

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.chooser(self.history(), logits)

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """The processed scores (beam search's log-probabilities): GenerationError where a row holds NaN or +inf
        (a row of -inf is a beam with nothing left to add, not an error)."""
        scores = self.chooser.process(self.history(), scores)
        self.chooser.steps += 1
        check_finite(scores.amax(-1), f"generation step {self.chooser.steps}: ", blocked=False)
        return scores

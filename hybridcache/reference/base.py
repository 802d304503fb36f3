"""What every reference returns: per prompt, the greedy tokens and the top-k logprobs of each step."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Generation:
    """One prompt's greedy continuation with per-step logprobs (JSON-friendly)."""

    prompt: list[int]
    tokens: list[int]
    token_logprobs: list[float]  # logprob of the chosen token at each step
    top_logprobs: list[dict[int, float]]  # top-k token -> logprob at each step
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["top_logprobs"] = [{str(k): v for k, v in step.items()} for step in self.top_logprobs]
        return data

    @classmethod
    def from_json(cls, data: Any) -> Generation:
        """A generation read back (a recording's line, a worker's answer), every field checked: token ids are
        integers (not strings, not bools), logprobs finite numbers, one logprob and one top-k step per token."""
        if not isinstance(data, dict):
            raise MalformedGeneration(f"a generation is a JSON object, got {_kind(data)}")
        missing = [k for k in ("prompt", "tokens", "token_logprobs", "top_logprobs") if k not in data]
        if missing:
            raise MalformedGeneration(f"missing {', '.join(missing)}")
        prompt = _token_ids("prompt", data["prompt"])
        if not prompt:
            raise MalformedGeneration("prompt is empty")
        tokens = _token_ids("tokens", data["tokens"])
        chosen = [_logprob(f"token_logprobs[{i}]", v) for i, v in enumerate(_list("token_logprobs", data))]
        steps = []
        for i, step in enumerate(_list("top_logprobs", data)):
            if not isinstance(step, dict) or not step:
                raise MalformedGeneration(f"top_logprobs[{i}] must be a non-empty {{id: logprob}}, got {_kind(step)}")
            steps.append({_token_key(i, k): _logprob(f"top_logprobs[{i}][{k!r}]", v) for k, v in step.items()})
        if not len(tokens) == len(chosen) == len(steps):
            raise MalformedGeneration(
                f"{len(tokens)} tokens, {len(chosen)} token_logprobs and {len(steps)} top_logprobs steps: one of each "
                "per generated token"
            )
        seconds = data.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise MalformedGeneration(f"seconds must be a finite number >= 0, got {seconds!r}")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise MalformedGeneration(f"meta must be a JSON object, got {_kind(meta)}")
        return cls(prompt, tokens, chosen, steps, float(seconds), dict(meta))


class MalformedGeneration(ValueError):
    """A generation read back (a line of a recording, a worker's answer) that is not what `to_json` writes: a missing
    key, a string where a token id goes, a logprob that is not a finite number <= 0, lengths that disagree."""


class ReferenceAnswerError(ValueError):
    """A live reference's worker answered something that is not an answer to the request (truncated JSON, another
    number of results, a malformed generation): the reference failed, not the settings."""


LOGPROB_SLACK = 1e-4  # a log-probability is <= 0; rounding in a float32 log-softmax stays far below this


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {str(value)[:40]!r}" if isinstance(value, str) else type(value).__name__


def _list(name: str, data: dict) -> list:
    value = data[name]
    if not isinstance(value, list):
        raise MalformedGeneration(f"{name} must be a list, got {_kind(value)}")
    return value


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise MalformedGeneration(f"{name} must be a list of token ids, got {_kind(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise MalformedGeneration(f"{name}[{i}] must be a token id (an integer >= 0), got {_kind(t)}")
    return list(value)


def _token_key(step: int, key: Any) -> int:
    """A top-k key: a token id, written as a JSON object key (a string of digits) or an integer."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise MalformedGeneration(f"top_logprobs[{step}] has key {key!r}, not a token id")


def _logprob(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedGeneration(f"{name} must be a number, got {_kind(value)}")
    if not math.isfinite(value) or value > LOGPROB_SLACK:
        raise MalformedGeneration(f"{name} must be a finite log-probability (<= 0), got {value!r}")
    return float(value)


def generation_from_logits(
    prompt: list[int], tokens: list[int], logits: torch.Tensor, top_k: int, seconds: float = 0.0
) -> Generation:
    """Build a Generation from the raw logits [T_new, V] each token was chosen from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)[: len(tokens)]
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    values, ids = logprobs.topk(top_k, dim=-1)
    top = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]
    return Generation(list(prompt), list(tokens), chosen.tolist(), top, seconds)


class ReferenceRunner(ABC):
    """Generates greedy continuations for token-id prompts."""

    name: str = "?"

    @abstractmethod
    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int) -> list[Generation]:
        """One Generation per prompt, greedy, up to max_new_tokens (stopping at the model's eos)."""

    def close(self) -> None:
        pass

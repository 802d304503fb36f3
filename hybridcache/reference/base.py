"""What every reference returns: per prompt, the greedy tokens and the top-k logprobs of each step."""

from __future__ import annotations

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
    def from_json(cls, data: dict[str, Any]) -> Generation:
        steps = [{int(k): float(v) for k, v in step.items()} for step in data["top_logprobs"]]
        return cls(
            list(data["prompt"]),
            list(data["tokens"]),
            list(data["token_logprobs"]),
            steps,
            float(data.get("seconds", 0.0)),
            dict(data.get("meta", {})),
        )


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

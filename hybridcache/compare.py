"""Comparing generations, after vLLM's `check_logprobs_close`, plus the oracle check.

Walk the greedy tokens; at the first mismatch each side's token must be in the other's top-k logprobs. Report the
agreed prefix (agreement = agreed steps / steps), the first divergence step, and max |Δlogprob| over the prefix.
The oracle check (cached vs use_cache=False under the same strategy) separates "the cache is wrong" (a bug) from
"the strategy changes the model" (the research result).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hybridcache.reference.base import Generation


@dataclass
class Comparison:
    steps: int  # the longer of the two generations
    agreed: int  # steps before the first divergence
    first_divergence: int | None  # None when identical
    topk_pass: bool  # identical, or each side's token in the other's top-k at the first divergence
    max_abs_dlogprob: float  # over the agreed prefix

    @property
    def agreement(self) -> float:
        return self.agreed / self.steps if self.steps else 1.0

    def to_json(self) -> dict:
        return {**asdict(self), "agreement": self.agreement}


def compare_generations(ours: Generation, ref: Generation) -> Comparison:
    if ours.prompt != ref.prompt:
        raise ValueError("the two generations start from different prompts")
    n = min(len(ours.tokens), len(ref.tokens))
    first = next((i for i in range(n) if ours.tokens[i] != ref.tokens[i]), None)
    if first is None and len(ours.tokens) != len(ref.tokens):
        first = n  # one side stopped early
    agreed = n if first is None else first
    if first is None:
        topk_pass = True
    elif first < n:
        topk_pass = ours.tokens[first] in ref.top_logprobs[first] and ref.tokens[first] in ours.top_logprobs[first]
    else:
        topk_pass = False
    deltas = [abs(a - b) for a, b in zip(ours.token_logprobs[:agreed], ref.token_logprobs[:agreed])]
    return Comparison(max(len(ours.tokens), len(ref.tokens)), agreed, first, topk_pass, max(deltas, default=0.0))


@dataclass
class OracleCheck:
    tokens_equal: bool
    max_abs_dlogit: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.max_abs_dlogit <= self.tolerance


def oracle_check(cached_tokens: torch.Tensor, cached_logits: torch.Tensor, oracle_tokens: torch.Tensor,
                 oracle_logits: torch.Tensor, tolerance: float) -> OracleCheck:
    """Cached generation vs the use_cache=False recompute under the same cache strategy."""
    equal = torch.equal(cached_tokens, oracle_tokens)
    n = min(cached_logits.shape[-2], oracle_logits.shape[-2])
    diff = (cached_logits[..., :n, :].float() - oracle_logits[..., :n, :].float()).abs().max().item() if n else 0.0
    return OracleCheck(equal, diff, tolerance)

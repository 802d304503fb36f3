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
    max_abs_dlogprob: float | None  # over the agreed prefix; None when no step agreed (nothing to compare)

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
    return Comparison(max(len(ours.tokens), len(ref.tokens)), agreed, first, topk_pass, max(deltas, default=None))


@dataclass
class OracleCheck:
    tokens_equal: bool  # the recompute's greedy choice equals the cached generation's token at every step
    max_abs_dlogit: float
    tolerance: float
    teacher_forced: bool = False  # the recompute was fed the cached generation's tokens

    @property
    def passed(self) -> bool:
        """Logits within tolerance. With teacher forcing, a token flip inside the tolerance is a near-tie (low
        precision), not a failure; with free-running oracles (`oracle_check`) the tokens must also be equal."""
        return self.max_abs_dlogit <= self.tolerance and (self.tokens_equal or self.teacher_forced)


def oracle_check(
    cached_tokens: torch.Tensor,
    cached_logits: torch.Tensor,
    oracle_tokens: torch.Tensor,
    oracle_logits: torch.Tensor,
    tolerance: float,
) -> OracleCheck:
    """Cached generation vs the use_cache=False generation under the same cache strategy."""
    equal = torch.equal(cached_tokens, oracle_tokens)
    n = min(cached_logits.shape[-2], oracle_logits.shape[-2])
    diff = (cached_logits[..., :n, :].float() - oracle_logits[..., :n, :].float()).abs().max().item() if n else 0.0
    return OracleCheck(equal, diff, tolerance)


def teacher_forced_check(
    tokens: torch.Tensor, cached_logits: torch.Tensor, oracle_logits: torch.Tensor, tolerance: float
) -> OracleCheck:
    """Cached generation's logits [T, V] vs the recompute's logits for the same tokens [T, V] (one forward over the
    whole generated sequence with a fresh cache under the same strategy): no divergence can compound."""
    n = min(cached_logits.shape[-2], oracle_logits.shape[-2])
    diff = (cached_logits[..., :n, :].float() - oracle_logits[..., :n, :].float()).abs().max().item() if n else 0.0
    equal = bool(torch.equal(oracle_logits[..., :n, :].argmax(-1).cpu(), tokens[..., :n].cpu()))
    return OracleCheck(equal, diff, tolerance, teacher_forced=True)

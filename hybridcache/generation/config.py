"""`GenerationConfig`: every scalar setting of `generate` in one object, named as in Hugging Face's GenerationConfig
where HF has the setting (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
use_cache, num_assistant_tokens is our num_draft_tokens, ...). `generate(model, ids, generation_config=cfg)` and
`generate(model, ids, max_new_tokens=..., ...)` are the same call; keywords override the config's fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridcache.generation.sampling import check_sampling
from hybridcache.models.core.base import GenerationError

SEED_RANGE = (-(2**63), 2**64)  # what torch's 64-bit generator seed takes (negative seeds wrap around)


class GenerationConfigError(GenerationError):
    """A generation setting no generation can use (a wrong type, a value out of range, two that exclude each other);
    raised by `GenerationConfig.validate` before any work."""


class UnknownGenerationSetting(GenerationConfigError, TypeError):
    """A keyword `generate` has no setting of (still a TypeError, as an unexpected keyword argument is)."""


def _positive_int(value: Any, allow_none: bool = False) -> bool:
    if value is None:
        return allow_none
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # sampling's generator seed (None: torch's global generator)
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None  # None: the model config's, else the first eos id, else 0
    use_cache: bool = True  # False: the oracle, every step recomputes the whole sequence
    prefill_chunk_size: int | None = None  # None: prompts over 1024 tokens are prefilled in 1024-token pieces
    compile: bool = False  # torch.compile the decode step over a preallocated cache
    num_draft_tokens: int = 4  # speculative decoding: tokens the draft proposes per round
    output_logits: bool = True  # False: keep only the tokens (logits are B x V floats per new token)
    decode_runs: bool = True  # False: each decode step feeds the cache itself (no decode runs: accel/runs/)

    def update(self, **kwargs: Any) -> GenerationConfig:
        """A copy with `kwargs` replacing fields; an unknown name is a GenerationConfigError naming it."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise UnknownGenerationSetting(
                f"unknown generation setting(s) {', '.join(unknown)}; GenerationConfig has {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **kwargs)

    def validate(self) -> GenerationConfig:
        """Raise a GenerationConfigError naming the first bad field; returns self."""
        if not _positive_int(self.max_new_tokens):
            raise GenerationConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _positive_int(self.prefill_chunk_size, allow_none=True):
            raise GenerationConfigError(
                f"prefill_chunk_size must be a positive integer or None, got {self.prefill_chunk_size!r}"
            )
        try:  # also when greedy: a bad value is a bug in the caller either way
            check_sampling(self.temperature, self.top_k, self.top_p)
        except GenerationError as e:
            raise GenerationConfigError(str(e)) from None
        for name in ("do_sample", "use_cache", "compile", "output_logits", "decode_runs"):
            if not isinstance(getattr(self, name), bool):
                raise GenerationConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]
        ):
            raise GenerationConfigError(
                f"seed must be None or an integer that fits torch's 64-bit seed, in [-2**63, 2**64), got {seed!r}"
            )
        if self.pad_token_id is not None and (
            isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0
        ):
            raise GenerationConfigError(f"pad_token_id must be None or a token id >= 0, got {self.pad_token_id!r}")
        if self.compile and not self.use_cache:
            raise GenerationConfigError(
                "compile=True compiles the cached decode step; it cannot be combined with use_cache=False"
            )
        return self

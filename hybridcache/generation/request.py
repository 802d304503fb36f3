"""`Request`: what one call of `generate` or `beam_search` asks for, built by ONE validation step.

`Request.build` checks everything before any work, in one order: the token ids, the mask, which options combine,
the cache against the batch, and whether the memory fits; then it resolves the eos and pad ids and moves the ids to
the model's device. A refusal is a named `GenerationError` (`CacheMemoryError` for memory) and changes nothing. The
settings themselves are checked by `GenerationConfig.validate` (config.py) before a request is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.generation.checks import check_generation_memory, check_options, request_mask
from hybridcache.generation.config import GenerationConfig
from hybridcache.generation.sampling import eos_ids, pad_token
from hybridcache.generation.sources.cached import check_real_rows
from hybridcache.models.core.base import HybridLM, check_input_ids, check_mask_tensor


@dataclass(frozen=True)
class Request:
    """A checked request. `rows` is the number of sequences decoded (batch x num_beams for beam search)."""

    input_ids: torch.Tensor  # [B, T] long, on the model's device
    mask: torch.Tensor  # [B, T] bool: the real tokens (left padding)
    eos: torch.Tensor  # [E] long: the ids that finish a row (E may be 0)
    pad_id: int  # written after a row's eos
    max_new_tokens: int

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        model: HybridLM,
        input_ids: Any,
        attention_mask: Any,
        cfg: GenerationConfig,
        *,
        cache: Any = None,
        cache_config: Mapping[str, Any] | None = None,
        draft_model: Any = None,
        prefix_cache: Any = None,
        processors: bool = False,
        num_beams: int = 1,
    ) -> Request:
        """Check a request (see the module docstring); `processors`: logits processors were passed; `num_beams` > 1
        sizes the memory check for beam search (every beam a row, three vocabulary-sized vectors per row)."""
        check_input_ids(input_ids, model.vocab_size)
        check_mask_tensor(attention_mask)
        if num_beams == 1:
            check_options(model, cfg, cache, cache_config, draft_model, prefix_cache, processors)
        batch, width = input_ids.shape
        if cache is not None:
            model.check_cache(cache, batch)
        check_generation_memory(
            model,
            cache,
            cache_config,
            batch * num_beams,
            width + cfg.max_new_tokens,
            cfg.max_new_tokens,
            cfg.output_logits and num_beams == 1,
            "this generation" if num_beams == 1 else f"beam search with num_beams={num_beams}",
            vocab_rows=1 if num_beams == 1 else 3,
        )
        device = model.device
        input_ids = input_ids.to(device)
        mask = request_mask(input_ids, attention_mask, device, " (the whole sequence)" if num_beams == 1 else "")
        check_real_rows(mask)
        eos = torch.tensor(eos_ids(cfg.eos_token_id, model.vocab_size), dtype=torch.long, device=device)
        return cls(input_ids, mask, eos, pad_token(model.config, cfg.pad_token_id, eos), cfg.max_new_tokens)

"""An HF transformers model behind the small interface the study's evaluation uses of our models (engine=hf):
`make_cache(batch, config)` returns our `Cache` (the one behind a `hybridcache.hf.cache_for` bridge, so its bytes,
snapshot / restore and plan are ours), `model(ids, cache=cache)` feeds one block through HF's own modeling code and
returns logits [B, T, V], `feed_block(ids, cache, last_only=True)`, `hf_generate` (greedy, what `hc.generate` does
for ours), `native_layers()`, `vocab_size`, `device`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


class HFModel:
    """HF's `model` (a PreTrainedModel) with our caches, called as the study calls our models."""

    def __init__(self, model: Any):
        self.hf = model
        self.config = model.config
        self.vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)

    @property
    def device(self) -> torch.device:
        return self.hf.device

    def parameters(self):
        return self.hf.parameters()

    def native_layers(self) -> list:
        from hybridcache.hf.build import layout_of
        from hybridcache.hf.native import bridge_plan

        return list(bridge_plan(layout_of(self.hf)).native)

    def make_cache(self, batch: int = 1, config: dict[str, Any] | None = None, max_length: int | None = None):
        """Our Cache under `config`, built now for `batch` rows behind the bridge that HF's code will call."""
        from hybridcache.hf import cache_for

        if max_length is not None:
            config = {**(config or {}), "max_length": max_length}
        bridge = cache_for(self.hf, config, batch_size=batch)
        bridge.hybrid.hf_bridge = bridge  # the forward finds its bridge from the cache the caller holds
        return bridge.hybrid

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits [B, T, V] of the block `ids` [B, T] after what `cache` has seen (no cache: the block alone)."""
        if cache is None:
            return self.hf(input_ids=ids, use_cache=False).logits
        bridge = cache.hf_bridge
        mask = torch.ones(ids.shape[0], bridge.columns + ids.shape[1], dtype=torch.long, device=ids.device)
        return self.hf(input_ids=ids, attention_mask=mask, past_key_values=bridge, use_cache=True).logits

    def feed_block(self, ids: torch.Tensor, cache, last_only: bool = False, **_: Any) -> torch.Tensor:
        logits = self(ids, cache=cache)
        return logits[:, -1:] if last_only else logits

    @torch.no_grad()
    def hf_generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        cache=None,
        cache_config: dict[str, Any] | None = None,
        prefill_chunk_size: int | None = None,
        eos_token_id: int | None = None,
        output_logits: bool = True,
    ) -> SimpleNamespace:
        """Greedy tokens after `ids` [B, T] as `hc.generate` gives them (`.sequences` [B, T + N]): the part of `ids`
        the cache has not seen is prefilled in chunks of `prefill_chunk_size`, then one token per forward."""
        cache = cache if cache is not None else self.make_cache(ids.shape[0], cache_config)
        seen = cache.hf_bridge.columns
        chunk = prefill_chunk_size or max(ids.shape[1] - seen, 1)
        for start in range(seen, ids.shape[1], chunk):
            logits = self(ids[:, start : start + chunk], cache=cache)[:, -1]
        seq = ids
        for i in range(max_new_tokens):
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, token], 1)
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool((token == eos_token_id).all())):
                break
            logits = self(token, cache=cache)[:, -1]
        return SimpleNamespace(sequences=seq, cache=cache)

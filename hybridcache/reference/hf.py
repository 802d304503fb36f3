"""HF transformers on the same checkpoint, greedy, as the live reference."""

from __future__ import annotations

import time

import torch

from hybridcache.reference.base import Generation, ReferenceRunner, generation_from_logits


class HFRunner(ReferenceRunner):
    name = "hf"

    def __init__(
        self, checkpoint: str, dtype: torch.dtype = torch.float32, device: str = "cpu", eos_token_id: int | None = None
    ) -> None:
        import transformers

        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
            .to(device)
            .eval()
        )
        self.device, self.eos_token_id = device, eos_token_id

    @torch.no_grad()
    def warmup(self, prompt: list[int]) -> None:
        """One short generation, untimed, so the timed ones are measured like ours (after a warm-up)."""
        ids = torch.tensor([prompt], device=self.device)
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            do_sample=False,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.eos_token_id or 0,
        )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, progress=None) -> list[Generation]:
        results = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=self.device)
            start = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.eos_token_id or 0,
            )
            seconds = time.perf_counter() - start
            tokens = out.sequences[0, len(prompt) :].tolist()
            results.append(generation_from_logits(prompt, tokens, torch.stack(out.logits, 1)[0], top_k, seconds))
            if progress is not None:
                progress()
        return results

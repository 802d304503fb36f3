"""Beam search for every family: `hc.beam_search(model, input_ids, num_beams=4, ...)`.

The prompt is prefilled once per row, the cache is repeated to B * num_beams rows, and after every step
`cache.reorder(index)` moves each surviving beam's history (attention KV and recurrent states alike) to its row.
Scoring follows Hugging Face's beam search: cumulative log-probabilities, 2 * num_beams candidates per row (more
with several eos ids), an eos candidate among the top num_beams finishes a hypothesis scored
sum_logprobs / generated_length ** length_penalty, and a row stops once num_beams hypotheses are finished and no
running beam can beat the worst (early_stopping=False). `use_cache=False` recomputes every beam from scratch each
step: the oracle for the reorder path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridcache.cache import Cache
from hybridcache.generation_checks import check_generation_memory, request_mask
from hybridcache.models.base import GenerationError, check_input_ids, check_mask_tensor
from hybridcache.sampling import eos_ids, pad_token


@dataclass
class BeamSearchOutput:
    sequences: torch.Tensor  # [B, T_prompt + T_new] (padded with pad_token_id after a short hypothesis)
    sequences_scores: torch.Tensor  # [B] the chosen hypothesis' length-normalised score
    cache: Cache | None  # the B * num_beams beams' cache after the last step


@torch.no_grad()
def beam_search(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_beams: int = 4,
    max_new_tokens: int = 16,
    eos_token_id: int | list[int] | None = None,
    length_penalty: float = 1.0,
    use_cache: bool = True,
    cache_config=None,
) -> BeamSearchOutput:
    """Beam search (see the module docstring); returns the best hypothesis per row."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise GenerationError(f"num_beams must be a positive integer, got {num_beams!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if (
        isinstance(length_penalty, bool)
        or not isinstance(length_penalty, (int, float))
        or not math.isfinite(length_penalty)
    ):
        raise GenerationError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not isinstance(use_cache, bool):
        raise GenerationError(f"use_cache must be True or False, got {use_cache!r}")
    check_input_ids(input_ids, model.vocab_size)
    check_mask_tensor(attention_mask)
    eos = eos_ids(eos_token_id, model.vocab_size)
    device, nb = model.device, num_beams
    batch, width = input_ids.shape
    # every beam is a row: its cache, its sequence and its scores, estimated before anything is repeated
    check_generation_memory(
        model,
        None,
        cache_config,
        batch * nb,
        width + max_new_tokens,
        max_new_tokens,
        False,
        f"beam search with num_beams={nb}",
        vocab_rows=3,
    )
    input_ids = input_ids.to(device)
    mask = request_mask(input_ids, attention_mask, device)
    eos = torch.tensor(eos, dtype=torch.long, device=device)
    pad_id = pad_token(model.config, None, eos)
    seqs = input_ids.repeat_interleave(nb, 0)  # [B * nb, T]
    bmask = mask.repeat_interleave(nb, 0)
    cache = None
    if use_cache:
        cache = model.make_cache(batch, cache_config)
        logits = model(input_ids, cache, mask if not bool(mask.all()) else None)[:, -1]
        cache.repeat(nb)  # row b * nb + j is beam j of row b
        logits = logits.repeat_interleave(nb, 0)
    else:
        logits = model(seqs, model.make_cache(batch * nb, cache_config), bmask)[:, -1]
    scores = torch.zeros(batch, nb, device=device, dtype=torch.float32)
    scores[:, 1:] = -1e9  # the first step expands one beam per row (the others are copies)
    finished: list[list[tuple[float, torch.Tensor]]] = [[] for _ in range(batch)]
    done = [False] * batch
    keep = max(2, 1 + eos.numel()) * nb
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # [B * nb, V]
        vocab = logp.shape[-1]
        cand = (logp.view(batch, nb, vocab) + scores[..., None]).view(batch, nb * vocab)
        top, idx = cand.topk(keep, dim=1)  # [B, 2 * nb], sorted
        beam, token = idx // vocab, idx % vocab
        new_beam = torch.zeros(batch, nb, dtype=torch.long, device=device)
        new_token = torch.zeros_like(new_beam)
        new_scores = torch.full_like(scores, -1e9)
        for b in range(batch):
            running = 0
            for rank in range(keep):
                tok, src, value = int(token[b, rank]), int(beam[b, rank]), float(top[b, rank])
                if eos.numel() and tok in eos.tolist():
                    if rank < nb and not done[b]:
                        hyp = torch.cat([seqs[b * nb + src], token.new_tensor([tok])])
                        _add(finished[b], hyp, value / ((step + 1) ** length_penalty), nb)
                    continue
                new_beam[b, running], new_token[b, running], new_scores[b, running] = src, tok, value
                running += 1
                if running == nb:
                    break
            if eos.numel() and len(finished[b]) == nb:
                best_running = float(new_scores[b].max()) / ((step + 1) ** length_penalty)
                done[b] = done[b] or min(s for s, _ in finished[b]) >= best_running
        rows = (torch.arange(batch, device=device)[:, None] * nb + new_beam).view(-1)  # [B * nb]
        seqs = torch.cat([seqs[rows], new_token.view(-1, 1)], dim=1)
        bmask = torch.cat([bmask[rows], torch.ones_like(bmask[:, :1])], dim=1)
        scores = new_scores
        if use_cache:
            cache.reorder(rows)  # every layer, attention KV and recurrent states, follows its beam
        if all(done) or step == max_new_tokens - 1:
            break
        if use_cache:
            logits = model(new_token.view(-1, 1), cache)[:, -1]
        else:
            logits = model(seqs, model.make_cache(batch * nb, cache_config), bmask)[:, -1]
    generated = seqs.shape[1] - width
    out, best_scores = [], []
    for b in range(batch):
        hyps = list(finished[b])
        if not done[b]:
            for j in range(nb):
                _add(hyps, seqs[b * nb + j], float(scores[b, j]) / (generated**length_penalty), nb)
        score, hyp = max(hyps, key=lambda h: h[0])
        out.append(hyp)
        best_scores.append(score)
    length = max(h.shape[0] for h in out)
    sequences = torch.stack([torch.cat([h, h.new_full((length - h.shape[0],), pad_id)]) for h in out])
    return BeamSearchOutput(sequences, torch.tensor(best_scores), cache)


def _add(hyps: list[tuple[float, torch.Tensor]], hyp: torch.Tensor, score: float, nb: int) -> None:
    """Keep the nb best finished hypotheses (HF's BeamHypotheses.add)."""
    if len(hyps) < nb or score > min(s for s, _ in hyps):
        hyps.append((score, hyp))
        if len(hyps) > nb:
            hyps.remove(min(hyps, key=lambda h: h[0]))

"""Beam search for every family: `hc.beam_search(model, input_ids, num_beams=4, ...)`.

A token source of generate's loop (generation/loop.py `token_loop`), as HF's beam scorer is a strategy over one decoding
loop: `BeamSource` owns the beams. The prompt is prefilled once per row, the cache is repeated to B * num_beams rows,
and every step the source scores the candidates, moves each surviving beam's tokens so far and its cache history
(`cache.reorder(index)`: attention KV and recurrent states alike) to its row, and hands the loop the new tokens; the
loop records them, pads the rows of finished requests and applies the stopping criteria.
Scoring follows Hugging Face's beam search: cumulative log-probabilities, 2 * num_beams candidates per row (more
with several eos ids), an eos candidate among the top num_beams finishes a hypothesis scored
sum_logprobs / generated_length ** length_penalty, and a row stops once num_beams hypotheses are finished and no
running beam can beat the worst (early_stopping=False). `use_cache=False` recomputes every beam from scratch each
step: the oracle for the reorder path. A stopping criterion sees the B * num_beams beam rows after each step; a
request finishes when it marks all of that request's beams (its running beams then become hypotheses, as at
max_new_tokens); a partial mark is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.accel import steady_unless_hooked
from hybridcache.cache import Cache
from hybridcache.generation.config import GenerationConfig
from hybridcache.generation.hooks import StoppingCriteriaList
from hybridcache.generation.loop import token_loop
from hybridcache.generation.request import Request
from hybridcache.generation.sampling import BoundChooser, TokenChooser
from hybridcache.generation.sources.cached import DecodeSource, GenerationState, Step
from hybridcache.models.core.base import GenerationError


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
    *,
    logits_processor: Iterable[Any] = (),
    stopping_criteria: Iterable[Any] = (),
) -> BeamSearchOutput:
    """Beam search (see the module docstring); returns the best hypothesis per row. `logits_processor`: callables
    (input_ids [B * num_beams, T], log-probs [B * num_beams, V]) -> scores, as HF applies them in beam search."""
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
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, output_logits=False)
    req = Request.build(model, input_ids, attention_mask, cfg, cache_config=cache_config, num_beams=num_beams)
    chooser, stop = TokenChooser(logits_processor), StoppingCriteriaList(stopping_criteria)
    input_ids, mask, eos, pad_id, nb, batch = req.input_ids, req.mask, req.eos, req.pad_id, num_beams, req.batch
    cache = model.make_cache(batch, cache_config) if use_cache else None
    source = BeamSource(
        model, cache, cache_config, nb, eos, length_penalty, GenerationState(input_ids, mask, input_ids[:, :0])
    )
    # row b * nb + j is beam j of request b
    beams = GenerationState(
        input_ids.repeat_interleave(nb, 0),
        mask.repeat_interleave(nb, 0),
        input_ids.new_full((batch * nb, max_new_tokens), pad_id),
    )
    # no code but ours between the steps (as generate): each kernel binding is made once (accel/runs/layer_records.py)
    with steady_unless_hooked(not chooser.processors and not stop, model):
        token_loop(source, chooser, stop, None, beams, pad_id, False)
    return source.result(beams, pad_id)


class BeamSource:
    """The beams of a batch: per request the running beams' scores and the finished hypotheses (HF's BeamScorer)."""

    def __init__(self, model, cache: Cache | None, cache_config, nb: int, eos, length_penalty: float, prompt) -> None:
        self.decoder = DecodeSource(model, cache, cache_config, None)  # feeds the prompt, then each step's tokens
        self.cache, self.nb, self.eos, self.length_penalty, self.prompt = cache, nb, eos, length_penalty, prompt
        batch = prompt.input_ids.shape[0]
        self.scores = torch.zeros(batch, nb, device=eos.device, dtype=torch.float32)  # [B, nb] cumulative log-probs
        self.scores[:, 1:] = -1e9  # the first step expands one beam per request (the others are copies)
        self.finished: list[list[tuple[float, torch.Tensor]]] = [[] for _ in range(batch)]
        self.done = [False] * batch
        self.keep = max(2, 1 + eos.numel()) * nb  # candidates per request: enough to fill nb beams past the eos ones

    def steps(self, choose: BoundChooser, state: GenerationState) -> Step:
        logits = self.prefill(state)
        while True:
            self.finish_stopped(state)
            logp = choose.process(torch.log_softmax(logits.float(), dim=-1))  # [B * nb, V]
            rows, tokens = self.select(logp, state)
            state.generated[:, : state.count] = state.generated[rows, : state.count]
            state.done = torch.tensor(self.done, device=rows.device).repeat_interleave(self.nb)
            if self.cache is not None:
                self.cache.reorder(rows)  # every layer, attention KV and recurrent states, follows its beam
            yield tokens, logp[rows]
            logits = self.decoder.next_logits(state)

    def prefill(self, state: GenerationState) -> torch.Tensor:
        """Logits [B * nb, V]: the prompt fed once per request, then its cache repeated to the beams."""
        if self.cache is None:
            return self.decoder.prefill(state)  # the oracle: every beam recomputed
        logits = self.decoder.prefill(self.prompt)
        self.cache.repeat(self.nb)  # row b * nb + j is beam j of request b
        return logits.repeat_interleave(self.nb, 0)

    def select(self, logp: torch.Tensor, state: GenerationState) -> tuple[torch.Tensor, torch.Tensor]:
        """The nb best candidates per request: the source rows [B * nb] and their tokens [B * nb]; eos candidates
        among the top nb become hypotheses."""
        batch, nb, step, eos = len(self.done), self.nb, state.count, self.eos.tolist()
        vocab = logp.shape[-1]
        cand = (logp.view(batch, nb, vocab) + self.scores[..., None]).view(batch, nb * vocab)
        top, idx = cand.topk(self.keep, dim=1)  # [B, keep], sorted
        beam, token = idx // vocab, idx % vocab
        new_beam = torch.zeros(batch, nb, dtype=torch.long, device=logp.device)
        new_token = torch.zeros_like(new_beam)
        new_scores = torch.full_like(self.scores, -1e9)
        seqs = state.sequences()
        for b in range(batch):
            running = 0
            for rank in range(self.keep):
                tok, src, value = int(token[b, rank]), int(beam[b, rank]), float(top[b, rank])
                if tok in eos:
                    if rank < nb and not self.done[b]:
                        hyp = torch.cat([seqs[b * nb + src], token.new_tensor([tok])])
                        _add(self.finished[b], hyp, value / ((step + 1) ** self.length_penalty), nb)
                    continue
                new_beam[b, running], new_token[b, running], new_scores[b, running] = src, tok, value
                running += 1
                if running == nb:
                    break
            if eos and len(self.finished[b]) == nb:
                best_running = float(new_scores[b].max()) / ((step + 1) ** self.length_penalty)
                self.done[b] = self.done[b] or min(s for s, _ in self.finished[b]) >= best_running
        self.scores = new_scores
        rows = (torch.arange(batch, device=logp.device)[:, None] * nb + new_beam).view(-1)  # [B * nb]
        return rows, new_token.view(-1)

    def finish_stopped(self, state: GenerationState) -> None:
        """Requests whose every beam a stopping criterion marked: their running beams become hypotheses."""
        marked = state.done.view(-1, self.nb).all(1).tolist()
        for b, stopped in enumerate(marked):
            if stopped and not self.done[b]:
                self.close(b, state)

    def close(self, b: int, state: GenerationState) -> None:
        """Request b ends here: its running beams join its hypotheses at their length (HF's finalize)."""
        seqs = state.sequences()
        for j in range(self.nb):
            score = float(self.scores[b, j]) / (state.count**self.length_penalty)
            _add(self.finished[b], seqs[b * self.nb + j], score, self.nb)
        self.done[b] = True

    def result(self, state: GenerationState, pad_id: int) -> BeamSearchOutput:
        """The best hypothesis per request, padded with pad_id to the longest."""
        out, best_scores = [], []
        for b in range(len(self.done)):
            if not self.done[b]:
                self.close(b, state)
            score, hyp = max(self.finished[b], key=lambda h: h[0])
            out.append(hyp)
            best_scores.append(score)
        length = max(h.shape[0] for h in out)
        sequences = torch.stack([torch.cat([h, h.new_full((length - h.shape[0],), pad_id)]) for h in out])
        return BeamSearchOutput(sequences, torch.tensor(best_scores), self.cache)

    def finish(self, out: Any, state: GenerationState) -> None:
        return None


def _add(hyps: list[tuple[float, torch.Tensor]], hyp: torch.Tensor, score: float, nb: int) -> None:
    """Keep the nb best finished hypotheses (HF's BeamHypotheses.add)."""
    if len(hyps) < nb or score > min(s for s, _ in hyps):
        hyps.append((score, hyp))
        if len(hyps) > nb:
            hyps.remove(min(hyps, key=lambda h: h[0]))

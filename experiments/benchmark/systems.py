"""The benchmark's systems as timed phases (experiments/benchmark/timing.py): prefill = a 1-token generation; decode =
the
decode steps themselves, never a difference of two totals.

Ours: the decode continues the prefill's own cache (generation's continuation rule), so the timed call runs exactly
the new - 1 one-token steps. HF: one full `generate` with a streamer that stamps the first generated token; decode =
end - that stamp (the same new - 1 steps)."""

from __future__ import annotations

import torch

import hybridcache as hc
from experiments.benchmark.timing import Clock, Phases


def ours_phases(model, ids: torch.Tensor, new: int, cache_config, compile: bool, warmup: int) -> Phases:
    """Tokens only (output_logits=False), as HF's generate without scores: keeping every step's [B, V] logits costs
    page faults and copies (7% of a float32 batch-8 step on a 262k vocabulary)."""
    batch, prompt = ids.shape
    state: dict = {}

    def first_token():
        # compile: a preallocated (static-shape) cache sized for the whole run, so the continuation can reuse it
        cache = model.make_cache(batch, cache_config, prompt + new) if compile else None
        return hc.generate(
            model, ids, max_new_tokens=1, cache=cache, cache_config=None if compile else cache_config,
            compile=compile, output_logits=False,
        )  # fmt: skip

    def rest(out):
        return hc.generate(
            model, out.sequences, max_new_tokens=new - 1, cache=out.cache, compile=compile, output_logits=False
        )

    def prefill(clock: Clock) -> float:
        start = clock()
        state["out"] = first_token()
        return clock() - start

    def decode(clock: Clock) -> float:
        out = state.pop("out")
        start = clock()
        rest(out)
        return clock() - start

    def warm():
        for _ in range(warmup):  # compiles the decode step outside the timed region when compile=True
            rest(first_token())

    return Phases(prefill, decode, warm)


class _FirstToken:
    """A transformers streamer that stamps the moment the first generated token arrives (its first `put` is the
    prompt, the second the first new token)."""

    def __init__(self, clock: Clock):
        self.clock, self.puts, self.first = clock, 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = self.clock()

    def end(self) -> None:
        pass


def hf_phases(ref, ids: torch.Tensor, new: int, warmup: int) -> Phases:
    def gen(n: int, streamer=None):
        with torch.no_grad():
            return ref.generate(
                ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer
            )

    def prefill(clock: Clock) -> float:
        start = clock()
        gen(1)
        return clock() - start

    def decode(clock: Clock) -> float:
        stamp = _FirstToken(clock)
        gen(new, stamp)
        end = clock()
        return end - stamp.first if stamp.first is not None else float("nan")

    def warm():
        for _ in range(warmup):
            gen(2)

    return Phases(prefill, decode, warm)

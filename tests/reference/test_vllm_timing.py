"""The vLLM worker's benchmark timing, driven with a fake engine and a fake clock (no vLLM here): prefill and decode
are each timed at the engine steps where they begin and end, never by subtracting one total from another, and the
benchmark judges each phase's samples like ours."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from experiments.benchmark.main import vllm_rates
from hybridcache.reference import vllm_worker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeEngine:
    """vLLM's LLMEngine surface the worker steps: a request needs `prefill_steps[i]` steps (each `prefill_cost` s)
    before its first token, then one token per step (each `decode_cost` s); outputs are cumulative, as in vLLM."""

    def __init__(self, clock, prefill_steps, prefill_cost, decode_cost, n, drop_last=False):
        self.clock, self.prefill_steps, self.n = clock, list(prefill_steps), n
        self.prefill_cost, self.decode_cost, self.drop_last = prefill_cost, decode_cost, drop_last
        self.requests: dict[str, dict] = {}

    def add_request(self, request_id, prompt, params):
        assert params.max_tokens == self.n and params.ignore_eos
        i = len(self.requests) % len(self.prefill_steps)
        self.requests[request_id] = {"left": self.prefill_steps[i], "tokens": []}

    def has_unfinished_requests(self):
        limit = self.n - 1 if self.drop_last else self.n
        return any(len(r["tokens"]) < limit and r["left"] >= 0 for r in self.requests.values())

    def step(self):
        prefilling = any(r["left"] > 0 for r in self.requests.values())
        self.clock.now += self.prefill_cost if prefilling else self.decode_cost
        out = []
        for rid, r in list(self.requests.items()):
            if r["left"] > 0:
                r["left"] -= 1
                if r["left"] > 0:
                    continue
            if self.drop_last and len(r["tokens"]) == self.n - 1:
                r["left"] = -1  # finished short
                continue
            r["tokens"].append(7)
            out.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(r["tokens"]))]))
            if len(r["tokens"]) == self.n:
                del self.requests[rid]
        return out


def params(temperature, max_tokens, ignore_eos, detokenize):
    return SimpleNamespace(max_tokens=max_tokens, ignore_eos=ignore_eos)


def llm_for(engine):
    return SimpleNamespace(llm_engine=engine)


def test_phases_are_timed_where_they_begin_and_end():
    clock = Clock()
    # two requests: one needs 3 prefill steps, the other 1; 6 tokens each
    engine = FakeEngine(clock, prefill_steps=[3, 1], prefill_cost=0.5, decode_cost=0.01, n=6)
    request = {"max_new_tokens": 6, "repeats": 3, "timing": [{"prompts": [[5, 6, 7], [8, 9]]}]}
    (t,) = vllm_worker.timings(llm_for(engine), request, params, dict, clock=clock)
    assert t["batch"] == 2
    # prefill ends when the slower request has its first token: 3 steps of 0.5 s; the rest are decode steps
    assert t["prefill_samples"] == pytest.approx([1.5] * 3)
    # after that step the slow request still needs 5 tokens (the fast one finishes meanwhile): 5 decode steps
    assert t["decode_samples"] == pytest.approx([0.05] * 3)


def test_a_run_short_of_tokens_is_refused():
    clock = Clock()
    engine = FakeEngine(clock, prefill_steps=[1], prefill_cost=0.5, decode_cost=0.01, n=4, drop_last=True)
    request = {"max_new_tokens": 4, "repeats": 1, "timing": [{"prompts": [[5, 6]]}]}
    with pytest.raises(RuntimeError, match="expected 4 tokens"):
        vllm_worker.timings(llm_for(engine), request, params, dict, clock=clock)


class FakeRunner:
    engine_seconds = 40.0

    def __init__(self, samples):
        self.samples, self.asked = samples, None

    def time_batches(self, batches, new_tokens, repeats):
        self.asked = (len(batches), new_tokens, repeats)
        return [{"batch": len(b), **self.samples} for b in batches]


def test_benchmark_judges_each_vllm_phase_and_asks_for_enough_repeats():
    b = OmegaConf.create({"batch_sizes": [1, 2], "prompt_tokens": 8, "new_tokens": 9, "repeats": 1})
    runner = FakeRunner({"prefill_samples": [0.1, 0.1, 0.1], "decode_samples": [0.4, 0.4, 0.4]})
    rows = vllm_rates(runner, b, 384, max_spread=0.25)
    assert runner.asked == (2, 9, 3)  # at least MIN_REPEATS runs, so a spread can be judged
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[1]["prefill_tok_s"] == pytest.approx(2 * 8 / 0.1)
    assert rows[1]["decode_tok_s"] == pytest.approx(2 * 8 / 0.4)  # the other new - 1 tokens
    assert rows[0]["engine_start_s"] == 40.0
    noisy = vllm_rates(FakeRunner({"prefill_samples": [0.1] * 4, "decode_samples": [0.1, 0.5, 0.9, 0.2]}), b, 384, 0.25)
    assert noisy[0]["decode_tok_s"] is None and "spread" in noisy[0]["decode_unreliable"]

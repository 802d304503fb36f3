"""Generated bad arguments to generate, beam_search and speculative decoding (generate(draft_model=...)) on the tiny
Gemma3: each a named error (GenerationError, CacheError, ConfigError, ...) and a cache passed in left bit-identical."""

import pytest
import torch

import hybridcache as hc
from tests.cache.helpers import state_equal
from tests.hostile.kit import report, rng, run_cases
from tests.models.conftest import prompts

NAN, INF = float("nan"), float("inf")
META = lambda *s: torch.zeros(*s, dtype=torch.long, device="meta")  # noqa: E731
NOT_INTS = [1.5, NAN, INF, "3", "", [1], (2,), {1: 2}, b"1", 1j, object(), torch.tensor(1.5), True]
NOT_FLAGS = ["yes", "", 1, 0, None, 1.0, [True], torch.tensor(True), NAN]
BAD_CONFIGS = [
    {"attention": {"type": "nope"}},
    "int8",
    5,
    [1],
    {"layers": {"99": {"type": "full"}}},
    {"full": {"window": -1}},
    {"attention": {"storage": "int9"}},
    {"bogus": {}},
    {"sliding": {"type": "mamba"}},
    {"attention": {"window": "8"}},
]


def bad_ids(r, vocab, batch=2, width=6):
    kind = r.randrange(9)
    if kind == 0:
        return torch.rand(batch, width) * vocab
    if kind == 1:
        return r.choice([torch.randint(3, 9, (width,)), torch.randint(3, 9, (batch, width, 1)), torch.tensor(5)])
    if kind == 2:
        return torch.zeros(r.choice([(batch, 0), (0, width), (0, 0)]), dtype=torch.long)
    if kind == 3:
        t = torch.randint(3, 9, (batch, width))
        t[r.randrange(batch), r.randrange(width)] = r.choice([vocab, vocab + 1, 10**9, 2**62, -1, -(2**40)])
        return t
    if kind == 4:
        return META(batch, width)
    if kind == 5:
        return r.choice([[[5, 6, 7]], "hello", None, 5, object()])
    if kind == 6:
        return torch.ones(batch, width, dtype=r.choice([torch.bool, torch.complex64, torch.float16]))
    if kind == 7:
        t = torch.full((batch, width), NAN)
        return t
    return torch.randint(3, 9, (batch, width)).to(r.choice([torch.uint8, torch.int8])) * -1


def bad_mask(r, batch=2, width=6):
    kind = r.randrange(7)
    if kind == 0:
        return torch.ones(
            r.choice([(batch, width + 1), (batch + 1, width), (width,), (batch, width, 1)]), dtype=torch.long
        )
    if kind == 1:
        m = torch.ones(batch, width, dtype=torch.long)
        m[r.randrange(batch), r.randrange(width)] = r.choice([2, -1, 9])
        return m
    if kind == 2:
        return torch.full((batch, width), r.choice([0.5, NAN, INF]))
    if kind == 3:
        return META(batch, width)
    if kind == 4:
        m = torch.ones(batch, width, dtype=torch.long)
        m[r.randrange(batch)] = 0  # a row without a real token
        return m
    if kind == 5:
        m = torch.ones(batch, width, dtype=torch.long)
        m[r.randrange(batch), width - 1 - r.randrange(width - 1)] = 0  # padding after a real token (right padding)
        return m
    return r.choice([[[1] * width] * batch, "ones", 1, object()])


GENERATE_ARGS = {
    "max_new_tokens": lambda r: r.choice([0, -1, -(10**9), *NOT_INTS, None, 10**12, 10**30]),
    "temperature": lambda r: r.choice([0, 0.0, -1.0, NAN, INF, -INF, 1e-300, 1e-39, "1", None, True, [1.0], 1j]),
    "top_k": lambda r: r.choice([0, -1, 1.5, "5", True, NAN, [5], -(10**30)]),  # above V: no filter
    "top_p": lambda r: r.choice([0, 0.0, -0.1, 1.5, 2, NAN, INF, "0.9", True, [0.5]]),
    "seed": lambda r: r.choice([2**64, 2**70, -(2**63) - 1, -(10**30), 1.5, "1", True, NAN, [1], torch.tensor(1)]),
    "eos_token_id": lambda r: r.choice(
        [10**9, 384, -1, 1.5, "2", [1, 10**9], True, NAN, [True], {1}, [[1]]]
    ),  # [] is no eos
    "prefill_chunk_size": lambda r: r.choice([0, -1, 1.5, "2", True, NAN, [2]]),
    "do_sample": lambda r: r.choice(NOT_FLAGS),
    "use_cache": lambda r: r.choice(NOT_FLAGS),
    "compile": lambda r: r.choice(NOT_FLAGS),
    "output_logits": lambda r: r.choice(NOT_FLAGS),
    "cache_config": lambda r: r.choice(BAD_CONFIGS),
    "cache": lambda r: r.choice(["x", 5, {}, torch.zeros(2)]),
    "prefix_cache": lambda r: r.choice(["x", 5, {}, object()]),
    "attention_mask": lambda r: bad_mask(r),
    "input_ids": None,  # bad_ids (needs the vocabulary)
}
BEAM_ARGS = {
    "num_beams": lambda r: r.choice([0, -1, 10**9, 10**12, *NOT_INTS, None]),
    "max_new_tokens": GENERATE_ARGS["max_new_tokens"],
    "eos_token_id": GENERATE_ARGS["eos_token_id"],
    "length_penalty": lambda r: r.choice([NAN, INF, -INF, "1", True, None, [1.0], 1j]),
    "use_cache": GENERATE_ARGS["use_cache"],
    "cache_config": GENERATE_ARGS["cache_config"],
    "attention_mask": lambda r: bad_mask(r),
    "input_ids": None,
}
SPECULATIVE_ARGS = {
    "num_draft_tokens": lambda r: r.choice([0, -1, -(10**9), *NOT_INTS, None, 10**12]),
    "draft_model": lambda r: r.choice(["x", 5, {}, object(), torch.nn.Linear(2, 2)]),
    "logits_processor": lambda r: [lambda ids, scores: scores],  # verification reads the target's own distribution
    "compile": lambda r: True,
    "use_cache": lambda r: False,
    "draft_cache_config": lambda r: r.choice(BAD_CONFIGS),
    "prefix_cache": lambda r: r.choice(["x", 5]),
    "max_new_tokens": GENERATE_ARGS["max_new_tokens"],
    "eos_token_id": GENERATE_ARGS["eos_token_id"],
    "attention_mask": lambda r: bad_mask(r),
    "input_ids": None,
}


@pytest.fixture(scope="module")
def model(models):
    return models("gemma3")[0]


@pytest.fixture(scope="module")
def draft(checkpoints):
    return hc.from_pretrained(checkpoints("gemma3"))


def _cases(r, model, table, count, call, extra=None):
    """`count` calls, each with 1-2 arguments of `table` replaced by bad values (the rest valid)."""
    for _ in range(count):
        names = r.sample(sorted(table), r.choice([1, 1, 2]))
        kwargs = dict(extra or {})
        for name in names:
            kwargs[name] = bad_ids(r, model.vocab_size) if name == "input_ids" else table[name](r)
        yield f"{call.__name__}({', '.join(f'{k}={v!r}'[:80] for k, v in kwargs.items() if k in names)})", kwargs


def _run(category, r, model, table, count, call, extra=None, with_cache=False):
    ids = prompts(2, 6, seed=3)
    cache = before = None
    if with_cache:
        out = hc.generate(model, ids, max_new_tokens=2)
        cache, before, ids = out.cache, out.cache.snapshot(), out.sequences
    cases = []
    for desc, kwargs in _cases(r, model, table, count, call, extra):
        if with_cache and "cache" not in kwargs and "cache_config" not in kwargs:
            kwargs["cache"] = cache
        kwargs.setdefault("max_new_tokens", 2)
        args = {k: v for k, v in kwargs.items() if k != "input_ids"}
        i = kwargs.get("input_ids", ids)
        cases.append((desc, lambda args=args, i=i: call(model, i, **args)))

    def unchanged():
        if cache is None or state_equal(cache.snapshot(), before):
            return None
        cache.restore(before)
        return "the cache passed in changed"

    return run_cases(category, cases, unchanged), len(cases)


@pytest.mark.parametrize("with_cache", [False, True], ids=["new cache", "continued cache"])
def test_generated_bad_generate_calls(model, with_cache):
    r = rng(f"generate:{with_cache}")
    problems, n = _run("generate", r, model, GENERATE_ARGS, 200, hc.generate, with_cache=with_cache)
    assert not problems, report(problems, n)


def test_generated_bad_beam_search_calls(model):
    problems, n = _run("beam search", rng("beam"), model, BEAM_ARGS, 200, hc.beam_search)
    assert not problems, report(problems, n)


@pytest.mark.parametrize("with_cache", [False, True], ids=["new cache", "continued cache"])
def test_generated_bad_speculative_calls(model, draft, with_cache):
    r = rng(f"speculative:{with_cache}")
    table = dict(SPECULATIVE_ARGS)
    problems, n = _run(
        "speculative", r, model, table, 100, hc.generate, extra={"draft_model": draft}, with_cache=with_cache
    )
    assert not problems, report(problems, n)

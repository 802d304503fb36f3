"""Hostile arguments to generate / beam_search / the model / from_pretrained / configs / rotary: each is a named
error raised before any work, and a cache passed in is left exactly as it was (on the tiny Gemma3)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache.core import limits
from hybridcache.cache.core.errors import CacheMemoryError
from hybridcache.generation.loop import MIN_TEMPERATURE, GenerationError, sample_next
from hybridcache.models import ArgumentError, ConfigError
from tests.cache.helpers import state_equal
from tests.models.conftest import prompts

META = torch.zeros(2, 6, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def model(models):
    return models("gemma3")[0]


@pytest.fixture
def one_gib(monkeypatch):
    """A machine with 1 GiB available (so the tests do not depend on this one's memory)."""
    monkeypatch.setattr(limits, "available_bytes", lambda device: 1 << 30)


def _continued(model):
    """A cache that saw 6 tokens, its snapshot and the whole sequence to continue it with."""
    ids = prompts(2, 6, seed=3)
    out = hc.generate(model, ids, max_new_tokens=2)
    return out.cache, out.cache.snapshot(), out.sequences


BAD_REQUESTS = {
    "temperature 1e-300": (dict(do_sample=True, temperature=1e-300), GenerationError, "temperature must be >="),
    "temperature 1e-300 greedy": (dict(temperature=1e-300), GenerationError, "temperature must be >="),
    "temperature below float32": (dict(do_sample=True, temperature=1e-39), GenerationError, "smallest normal float32"),
    "seed 2**70": (dict(seed=2**70), GenerationError, "fits torch's 64-bit seed"),
    "seed 2**64": (dict(do_sample=True, seed=2**64), GenerationError, "fits torch's 64-bit seed"),
    "seed -2**63-1": (dict(seed=-(2**63) - 1), GenerationError, "64-bit"),
    "mask on meta": (dict(attention_mask=META), GenerationError, "meta device"),
    "max_new_tokens 1e12": (dict(max_new_tokens=10**12), CacheMemoryError, "needs at least"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_generate_requests_are_named_errors_that_change_nothing(model, name):
    kwargs, error, message = BAD_REQUESTS[name]
    cache, before, sequence = _continued(model)
    with pytest.raises(error, match=message):
        hc.generate(model, sequence, cache=cache, **kwargs)
    assert state_equal(cache.snapshot(), before)
    with pytest.raises(error, match=message):  # and without a cache
        hc.generate(model, prompts(2, 6, seed=0), **kwargs)


def test_token_ids_on_the_meta_device_are_refused(model):
    cache, before, _ = _continued(model)
    for call in (
        lambda: hc.generate(model, META),
        lambda: hc.generate(model, META, cache=cache),
        lambda: model(META),
        lambda: model(META[:, :1], cache),
        lambda: hc.beam_search(model, META),
        lambda: model(prompts(2, 1, seed=0), cache, attention_mask=META[:, :7]),
    ):
        with pytest.raises(GenerationError, match="meta device"):
            call()
    assert state_equal(cache.snapshot(), before)


def test_the_smallest_temperature_samples_without_overflow(model):
    logits = torch.tensor([[100.0, 99.0, -5.0], [-3.0, 50.0, 49.999]])
    g = torch.Generator().manual_seed(0)
    for t in (MIN_TEMPERATURE, 1e-37, 1e-30, 1e-6):
        assert sample_next(logits, t, None, None, g).tolist() == [0, 1]
    ids = prompts(2, 6, seed=0)
    cold = hc.generate(model, ids, max_new_tokens=4, do_sample=True, temperature=MIN_TEMPERATURE, seed=2**64 - 1)
    assert torch.equal(cold.sequences, hc.generate(model, ids, max_new_tokens=4).sequences)  # T -> 0: greedy


def test_seeds_across_the_whole_64_bit_range_work(model):
    ids = prompts(1, 4, seed=0)
    for seed in (0, 2**63, 2**64 - 1, -(2**63)):
        hc.generate(model, ids, max_new_tokens=2, do_sample=True, seed=seed)


def test_a_million_beams_are_refused_before_allocating(model, one_gib):
    ids = prompts(2, 6, seed=0)
    with pytest.raises(CacheMemoryError, match=r"beam search with num_beams=1000000 \(2000000 rows"):
        hc.beam_search(model, ids, num_beams=10**6)
    with pytest.raises(CacheMemoryError, match="num_beams=1000000"):
        hc.beam_search(model, ids, num_beams=10**6, use_cache=False)


def test_a_billion_beams_are_refused_on_any_machine(model):
    with pytest.raises(CacheMemoryError, match="needs at least"):
        hc.beam_search(model, prompts(1, 6, seed=0), num_beams=10**9)


def test_bad_beam_search_requests_are_named_errors(model):
    ids = prompts(2, 6, seed=0)
    for kwargs, message in (
        (dict(eos_token_id=1.5), "eos_token_id"),
        (dict(eos_token_id=10**9), "eos_token_id"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(use_cache="yes"), "use_cache"),
        (dict(attention_mask=torch.ones(2, 5)), "must match input_ids"),
        (dict(attention_mask=torch.full((2, 6), 2)), "only 0 and 1"),
    ):
        with pytest.raises(ValueError, match=message):
            hc.beam_search(model, ids, **kwargs)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        hc.beam_search(model, torch.full((1, 3), 10**6))


def test_a_growing_repeat_of_a_model_cache_is_refused(model, one_gib):
    cache, before, _ = _continued(model)
    with pytest.raises(CacheMemoryError, match=r"Cache.repeat to 2000000000000 rows"):
        cache.repeat(10**12)
    assert state_equal(cache.snapshot(), before)


def test_from_pretrained_refuses_bad_flags_and_devices_before_reading(checkpoints):
    path = checkpoints("gemma3")
    with pytest.raises(ArgumentError, match="from_pretrained: allow_nonfinite must be True or False, got 'yes'"):
        hc.from_pretrained(path, allow_nonfinite="yes")
    with pytest.raises(ConfigError, match="allow_dtype_cast must be True or False.*huge_pages must be True"):
        hc.from_pretrained(path, allow_dtype_cast=1, huge_pages="no")
    with pytest.raises(ArgumentError, match="device 'cuda:99' cannot be used here"):
        hc.from_pretrained(path, device="cuda:99")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_from_pretrained_on_cuda_without_cuda_is_a_named_error(checkpoints):
    with pytest.raises(ArgumentError, match="device 'cuda' cannot be used here"):
        hc.from_pretrained(checkpoints("gemma3"), device="cuda")


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", ["float33", "", 5, "Tensor"])
def test_a_config_dtype_that_is_no_dtype_is_refused(models, key, value):
    model = models("gemma3")[0]
    raw = {**model.config, key: value}
    with pytest.raises(ConfigError, match=f"{key} must be null or the name of a torch dtype"):
        type(model).config_class.from_hf(raw)


def test_a_config_dtype_that_is_a_dtype_loads(models):
    model = models("gemma3")[0]
    for value in ("float32", "bfloat16", "torch.float16", None):
        type(model).config_class.from_hf({**model.config, "torch_dtype": value, "dtype": value})


def test_a_checkpoint_with_a_bad_dtype_in_config_json_is_refused(checkpoints, tmp_path):
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints("gemma3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float33"}))
    with pytest.raises(ConfigError, match="torch_dtype must be null or the name of a torch dtype.*'float33'"):
        hc.from_pretrained(path)


@pytest.mark.parametrize(
    "positions",
    [
        torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]),  # T = 5 for q's T = 1: would broadcast to [B, H, 5, D]
        torch.tensor([5, 17]),  # [B]: cos/sin [B, 1, R]
        torch.tensor([[[5]], [[17]]]),  # [B, 1, 1]: cos/sin of rank 5
        torch.tensor([[5], [6], [7]]),  # 3 rows for q's 2
    ],
)
def test_rotary_tables_of_the_wrong_shape_are_refused(positions):
    from hybridcache.nn.attention.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    q, k = torch.randn(2, 3, 1, 8), torch.randn(2, 1, 1, 8)
    with pytest.raises(ValueError, match="rotary: cos has shape"):
        rotary(q, k, positions)
    rotary(q, k, torch.tensor([[5], [17]]))  # [B, T] works
    rotary(q, k, torch.tensor([[5]]))  # one row of positions for every row: broadcast on purpose


def test_rotary_q_and_k_must_agree():
    from hybridcache.nn.attention.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    with pytest.raises(ValueError, match="rotary: q and k must be"):
        rotary(torch.randn(2, 3, 1, 8), torch.randn(1, 1, 1, 8), torch.tensor([[5], [17]]))
    with pytest.raises(ValueError, match="D >= 8"):
        rotary(torch.randn(2, 3, 1, 4), torch.randn(2, 1, 1, 4), torch.tensor([[5], [17]]))


def test_a_cache_that_is_no_cache_is_refused_before_the_memory_estimate(model):
    with pytest.raises(TypeError, match="cache must be a hybridcache Cache"):
        hc.generate(model, prompts(1, 4, seed=0), cache="x")

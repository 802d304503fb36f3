"""Values out of range are refused like usage errors: one line, exit status 2, before torch is imported and before
Hydra creates the output directory (issue 41 item 7). Before: `cache.attention.window=-3` took 9-18 s (torch, the
checkpoint) to refuse and left an outputs/ directory with a results.json behind; `max_new_tokens=0`,
`model.device=tpu`, `cache.attention.type=bogus`, `cache.attention.storage=bogus` the same."""

from __future__ import annotations

import pytest

from experiments.core import value_checks
from experiments.core.usage import usage_error
from tests.app.test_cli_usage import CONFIGS, assert_usage_error


@pytest.mark.parametrize(
    "args,expected",
    [
        (["cache.attention.window=-3"], "cache.attention.window must be a positive integer, got -3"),
        (["max_new_tokens=0"], "max_new_tokens must be a positive integer, got 0"),
        (["top_k=-1"], "top_k must be a positive integer"),
        (["prefill_chunk_size=0"], "prefill_chunk_size must be a positive integer or null"),
        (["oracle_tolerance=-1.0"], "oracle_tolerance must be a positive number"),
        (["model.dtype=float17"], "model.dtype=float17 is not one of float32"),
        (["model.weights=int3"], "model.weights=int3 is not one of null, bfloat16, int8"),
        (["model.device=tpu"], "model.device=tpu is not a device torch knows"),
        (["model.device=cuda:-1"], "model.device=cuda:-1 is not a device"),
        (["logger.mode=off"], "logger.mode=off is not one of offline"),
        (["cache.recurrent.state_dtype=int3"], "cache.recurrent.state_dtype=int3 is not a floating-point dtype"),
        (["cache=snapkv", "cache.attention.compression_ratio=1.5"], "compression_ratio must be a number in [0, 1)"),
        (["cache.attention.type=bogus"], "cache.attention.type=bogus: unknown cache type; known types: chunked"),
        (["model=jamba", "cache=int8", "cache.attention.storage=bogus"], "unknown attention storage; known: dense"),
        (["+cache.layers.2.window=0"], "cache.layers.2.window must be a positive integer, got 0"),
        (["engine=gpu"], "engine=gpu is not one of ours, hf"),
        (["engine=hf", "experiment=drift"], "engine=hf runs correctness, benchmark, study; experiment=drift runs our"),
        (["experiment=benchmark", "experiment.batch_sizes=[1,0]"], "every entry of experiment.batch_sizes must be"),
        (["experiment=study", "experiment.block=0"], "experiment.block must be a positive integer, got 0"),
        (["-m", "max_new_tokens=4,0"], "max_new_tokens must be a positive integer, got 0"),  # every value of a sweep
        # a press's eviction schedule was `mode` until 2026-11-29: the old name is told the new one
        (
            ["cache=snapkv", "cache.attention.mode=prefill"],
            "cache.attention.mode was renamed to cache.attention.schedule",
        ),
        (
            ["cache.attention.schedule=sometimes"],
            "cache.attention.schedule=sometimes is not one of prefill, continuous",
        ),
        (
            ["experiment=press_check", "experiment.decoding=[{method: tova, mode: decoding, budget: 8}]"],
            "experiment.decoding[0]: 'mode' was renamed to 'schedule'",
        ),
        (
            ["cache.recurrent.residual_codec=int4"],
            "cache.recurrent.residual_codec was renamed to cache.recurrent.error_codec",
        ),
        (["cache.recurrent.checkpoints=2"], "cache.recurrent.checkpoints was renamed to cache.recurrent.rollback"),
        # the study's strategy compared with was `experiment.reference` until 2026-11-29
        (["experiment=study", "experiment.reference=int8"], "experiment.reference was renamed to experiment.baseline"),
        (["experiment=long_context", "experiment.reference=int8"], "experiment.reference was renamed to"),
    ],
)
def test_a_value_out_of_range_is_refused_before_torch_and_before_the_output_directory(tmp_path, args, expected):
    assert_usage_error(tmp_path, args, expected)


@pytest.mark.parametrize(
    "argv",
    [
        ["model.device=cuda:1"],  # whether it exists is the run's own check
        ["model.device=meta"],
        ["cache=snapkv", "cache.attention.compression_ratio=0.0"],
        ["cache.recurrent.state_dtype=bfloat16"],
        ["+cache.plugins=[mypkg.sink]", "cache.attention.type=mysink"],  # a plugin's type: the run checks it
        ["oracle_tolerance=1"],
        ["prefill_chunk_size=null"],
        ["engine=hf"],
        ["experiment=benchmark", "experiment.warmup=0", "experiment.batch_sizes=[1,8]"],
        ["experiment=study", "experiment.baseline=int8"],
    ],
)
def test_values_in_range_pass(argv):
    assert usage_error(argv, CONFIGS) is None


def test_every_preset_passes_the_value_check():
    for preset in sorted(p.stem for p in (CONFIGS / "cache").glob("*.yaml")):
        assert usage_error([f"cache={preset}"], CONFIGS) is None, preset
    for experiment in sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")):
        assert usage_error([f"experiment={experiment}"], CONFIGS) is None, experiment


def test_the_names_match_what_torch_and_hybridcache_accept():
    """The check holds its own copies of the names (it runs before torch is imported): they must be the real ones."""
    import torch

    from experiments.core.common import DTYPES
    from hybridcache.cache import available_layers, get_layer_class
    from hybridcache.cache.storage.codecs import available_codecs, codec_class
    from hybridcache.nn.core.linear import WEIGHT_FORMATS

    assert set(value_checks.DTYPE_NAMES) == set(DTYPES)
    assert value_checks.WEIGHT_FORMATS == tuple(WEIGHT_FORMATS)
    from hybridcache.cache.core.plan import RENAMED_PARAMETERS

    assert value_checks.RENAMED_PARAMETERS == RENAMED_PARAMETERS

    # the built-in names: other tests of the same process register plugin types and storages of their own
    def ours(names, cls_of):
        return {n for n in names if cls_of(n).__module__.startswith("hybridcache.")}

    assert set(value_checks.CACHE_TYPES) == ours(available_layers(), get_layer_class)
    assert set(value_checks.STORAGES) == ours(available_codecs(), codec_class)
    for name in value_checks.DEVICE_TYPES:
        torch.device(name)  # parses (whether one is present is not asked here)
    with pytest.raises(RuntimeError):
        torch.device("tpu")

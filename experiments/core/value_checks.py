"""Whether each setting's value is in range, checked from the composed config alone (no torch, no files): run.py asks
before Hydra creates the output directory, so `max_new_tokens=0` or `cache.attention.window=-3` is refused in well
under a second and leaves nothing behind. Each run checks the same values again (`common.preflight`), with what only
torch and the checkpoint can say (a device that exists, a cache type that can serve a layer, a file that matches).

`value_problem(key, value)` answers for one dotted key; `config_problems(tree)` for every leaf of a composed config.
"""

from __future__ import annotations

import re
from typing import Any

from experiments.core.cache_config import DTYPE_FIELDS, SIZE_FIELDS, size_field_problem

#: model.dtype names (experiments.core.common.DTYPES maps them to torch dtypes; a test keeps the two equal).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
#: model.weights formats besides null (hybridcache.nn.core.linear.WEIGHT_FORMATS; a test keeps them equal).
WEIGHT_FORMATS = ("bfloat16", "int8", "q8_0")
#: Device types torch.device parses (c10's DeviceType names); whether one is present is the run's own check.
DEVICE_TYPES = (
    "cpu",
    "cuda",
    "mps",
    "xpu",
    "meta",
    "hip",
    "hpu",
    "mtia",
    "maia",
    "xla",
    "lazy",
    "vulkan",
    "ipu",
    "ve",
    "fpga",
    "opengl",
    "opencl",
    "ideep",
    "mkldnn",
    "privateuseone",
)
#: The cache types and attention storage formats hybridcache registers itself (hybridcache.cache.available_layers /
#: available_codecs; a test keeps them equal). A command with `cache.plugins` or an installed plugin package (entry
#: points) may register more: its names are left to the run.
CACHE_TYPES = (
    "chunked",
    "compressed_kv",
    "conv",
    "expected_attention",
    "full",
    "gated_delta",
    "h2o",
    "knorm",
    "linear_attention",
    "mamba",
    "mamba2",
    "observed_attention",
    "pyramidkv",
    "rglru",
    "sink",
    "sliding",
    "snapkv",
    "streaming_llm",
    "tova",
)
STORAGES = ("dense", "hf_quantized", "int4", "int8", "kivi", "offload")
PLUGIN_GROUP = "hybridcache.cache_layers"  # hybridcache.cache.core.registry.ENTRY_POINT_GROUP
LOGGER_MODES = ("offline", "online", "disabled")
ENGINES = ("ours", "hf")
#: Experiments that can run HF transformers' own modeling code with our cache (engine=hf; docs/hf_bridge.md).
HF_ENGINE = ("correctness", "benchmark", "study")
#: Float dtypes a recurrent state may be held in (cache_config._typed maps them to torch dtypes).
STATE_DTYPES = ("float32", "float64", "bfloat16", "float16")
PRESS_SCHEDULES = ("prefill", "continuous")
#: Cache parameters renamed (old -> new; hybridcache.cache.core.plan has the same, a test keeps them equal): a press's
#: eviction schedule was `mode`, error feedback's codec `residual_codec`, `rollback` was `checkpoints` (to 2026-11-29).
RENAMED_PARAMETERS = {"mode": "schedule", "residual_codec": "error_codec", "checkpoints": "rollback"}
#: Settings renamed (old dotted key -> new), told by their new name: the strategy the study compares every other with
#: was `experiment.reference` until 2026-11-29 ("reference" is only an independent implementation now).
RENAMED_SETTINGS = {"experiment.reference": "experiment.baseline"}


def _positive_int(key: str, value: Any, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{key} must be a positive integer{' or null' if allow_none else ''}, got {value!r}"
    return None


def _one_of(key: str, value: Any, known: tuple[str, ...], allow_none: bool = False) -> str | None:
    if (value is None and allow_none) or value in known:
        return None
    return f"{key}={value} is not one of {', '.join((['null'] if allow_none else []) + list(known))}"


def _device(value: Any) -> str | None:
    name = str(value)
    match = re.fullmatch(r"([a-z_]+)(?::(0|[1-9][0-9]*))?", name)
    if match is None or match.group(1) not in DEVICE_TYPES:
        known = ", ".join(DEVICE_TYPES[:5])
        return f"model.device={name} is not a device torch knows ({known}, ...; an index as in cuda:0)"
    return None


def _tolerance(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return f"oracle_tolerance must be a positive number or null (by dtype), got {value!r}"
    return None


TOP_LEVEL = {
    "max_new_tokens": lambda v: _positive_int("max_new_tokens", v),
    "top_k": lambda v: _positive_int("top_k", v),
    "prefill_chunk_size": lambda v: _positive_int("prefill_chunk_size", v, allow_none=True),
    "oracle_tolerance": _tolerance,
    "engine": lambda v: _one_of("engine", v, ENGINES),
    "model.dtype": lambda v: _one_of("model.dtype", v, DTYPE_NAMES),
    "model.weights": lambda v: _one_of("model.weights", v, WEIGHT_FORMATS, allow_none=True),
    "model.device": _device,
    "logger.mode": lambda v: _one_of("logger.mode", v, LOGGER_MODES),
}


#: Experiment settings that count something (the smallest valid value); lists: every entry. The rest of an
#: experiment's settings are its own run's checks.
EXPERIMENT_COUNTS = {
    "batch_sizes": 1,
    "prompt_tokens": 1,
    "new_tokens": 1,
    "repeats": 1,
    "warmup": 0,
    "lengths": 1,
    "block": 1,
    "documents": 1,
}


def _experiment_problem(key: str, value: Any) -> str | None:
    if key == "experiment.decoding" and isinstance(value, list):  # press_check's cases: `mode` renamed too
        for i, case in enumerate(value):
            if isinstance(case, dict) and "mode" in case:
                return f"experiment.decoding[{i}]: 'mode' was renamed to 'schedule'"
    smallest = EXPERIMENT_COUNTS.get(key.removeprefix("experiment."))
    if smallest is None or key.count(".") != 1:
        return None
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str) and "${" in v:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < smallest:
            kind = "a positive integer" if smallest else "an integer >= 0"
            what = f"every entry of {key}" if isinstance(value, list) else key
            return f"{what} must be {kind}, got {v!r}"
    return None


def renamed_problem(key: str) -> str:
    """`cache.<...>.<old>`: the parameter was renamed (hybridcache.cache.core.plan.RENAMED_PARAMETERS)."""
    head, _, old = key.lstrip("+~").rpartition(".")
    return f"{head}.{old} was renamed to {head}.{RENAMED_PARAMETERS[old]}"


def _cache_problem(key: str, value: Any) -> str | None:
    """A field of a cache entry: `cache.<entry>.<field>`, `cache.layers.<i>.<field>` or `.<i>.<member>.<field>`."""
    parts = key.split(".")
    field, where = parts[-1], ".".join(parts[1:])
    if field in RENAMED_PARAMETERS and len(parts) >= 3:
        return renamed_problem(key)
    if value is None or len(parts) < 3:
        return None
    if field in SIZE_FIELDS:
        return size_field_problem(where, field, value)
    if field in DTYPE_FIELDS and value not in STATE_DTYPES and str(value).removeprefix("torch.") not in STATE_DTYPES:
        return f"cache.{where}={value} is not a floating-point dtype ({', '.join(STATE_DTYPES)})"
    if field == "compression_ratio" and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1
    ):
        return f"cache.{where} must be a number in [0, 1), got {value!r}"
    if field == "schedule" and value not in PRESS_SCHEDULES:
        return f"cache.{where}={value} is not one of {', '.join(PRESS_SCHEDULES)}"
    return None


def value_problem(key: str, value: Any) -> str | None:
    """Why `value` cannot be the setting `key` (dotted, as on the command line), or None. Interpolations are left to
    the run (they resolve there)."""
    if isinstance(value, str) and "${" in value:
        return None
    key = key.lstrip("+~")
    if key in TOP_LEVEL:
        return TOP_LEVEL[key](value)
    if key.startswith("cache."):
        return _cache_problem(key, value)
    if key.startswith("experiment."):
        return _experiment_problem(key, value)
    return None


def config_problems(tree: dict[str, Any]) -> list[str]:
    """Every out-of-range value in a composed config (a plain, unresolved container), in key order; cache type and
    storage names too unless plugins may add some."""
    names = not _plugins_possible(tree.get("cache"))
    problems = _problems(tree, "", names)
    experiment = (tree.get("experiment") or {}).get("name")
    if tree.get("engine") == "hf" and isinstance(experiment, str) and experiment not in HF_ENGINE:
        problems.append(engine_problem(experiment))
    return problems


def engine_problem(experiment: str) -> str:
    return f"engine=hf runs {', '.join(HF_ENGINE)}; experiment={experiment} runs our model code only (engine=ours)"


def _problems(tree: dict[str, Any], prefix: str, names: bool) -> list[str]:
    problems: list[str] = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            problems += _problems(v, key + ".", names)
        else:
            problem = value_problem(key, v) or (_name_problem(key, v) if names and not isinstance(v, list) else None)
            if problem:
                problems.append(problem)
    return problems


def _name_problem(key: str, value: Any) -> str | None:
    if not key.startswith("cache.") or value is None or (isinstance(value, str) and "${" in value):
        return None
    field = key.rsplit(".", 1)[-1]
    if field == "type" and value not in CACHE_TYPES:
        return (
            f"{key}={value}: unknown cache type; known types: {', '.join(CACHE_TYPES)} (a type from another module "
            "needs `cache.plugins: [module]`)"
        )
    if field == "storage" and value not in STORAGES:
        return f"{key}={value}: unknown attention storage; known: {', '.join(STORAGES)}"
    return None


def _plugins_possible(cache: Any) -> bool:
    """Whether this command may register cache types or storages of its own (cache.plugins, installed plugins)."""
    from importlib import metadata

    if isinstance(cache, dict) and cache.get("plugins"):
        return True
    try:
        return bool(metadata.entry_points(group=PLUGIN_GROUP))
    except Exception:  # noqa: BLE001 - unreadable package metadata: leave the names to the run
        return True

"""The registry of model families: `@register_family("model_type")` on a `HybridLM` subclass adds one.

A family is one module whose model class carries the decorator; `from_pretrained` picks it by the checkpoint's HF
`model_type`. In-tree families are imported when first asked for (`BUILTIN`: model_type -> module); a family
outside hybridcache is found the way cache-type plugins are: an installed package declares its module under the
entry-point group `hybridcache.cache_layers` (one group for every kind of plugin: importing the module registers
whatever it defines, cache types and families alike), or the app imports it (`load_plugins(["mypkg.family"])`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from hybridcache.cache.core import registry as cache_registry
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import ConfigError, FamilyConfig

# HF model_type -> the in-tree module that registers it (imported on first use, so loading one family is cheap)
BUILTIN = {
    "kimi_linear": "hybridcache.models.families.kimi_linear",
    "bailing_hybrid": "hybridcache.models.families.bailing_hybrid",
    "jamba": "hybridcache.models.families.jamba",
    "mamba": "hybridcache.models.families.mamba",
    "mamba2": "hybridcache.models.families.mamba2",
    "recurrent_gemma": "hybridcache.models.families.recurrentgemma",
    "gemma3_text": "hybridcache.models.families.gemma3",
    "gemma4_text": "hybridcache.models.families.gemma4",
    "llama4_text": "hybridcache.models.families.llama4",
    "qwen3_next": "hybridcache.models.families.qwen3_next",
    "bamba": "hybridcache.models.families.bamba",
    "falcon_h1": "hybridcache.models.families.falcon_h1",
    "zamba2": "hybridcache.models.families.zamba2",
    "zamba": "hybridcache.models.families.zamba",
    "lfm2": "hybridcache.models.families.lfm2",
    "nemotron_h": "hybridcache.models.families.nemotron_h",
    "granitemoehybrid": "hybridcache.models.families.granitemoehybrid",
    "qwen3_5_text": "hybridcache.models.families.qwen3_5",
    "lfm3": "hybridcache.models.families.lfm3",
    "granite_swa": "hybridcache.models.families.granite_swa",
    "gpt_oss": "hybridcache.models.families.gpt_oss",
    "olmo_hybrid": "hybridcache.models.families.olmo_hybrid",
    "glm5_next_text": "hybridcache.models.families.glm5_next",
    "glm5_next": "hybridcache.models.families.glm5_next",
}

_FAMILIES: dict[str, type[HybridLM]] = {}
M = TypeVar("M", bound=type[HybridLM])


def register_family(model_type: str, *, replace: bool = False) -> Callable[[M], M]:
    """Class decorator: `model_type` (HF's config.json key) is served by this `HybridLM` subclass, which must name
    its typed config (`config_class`, a FamilyConfig subclass). A taken name is an error unless `replace=True`."""
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError("model", [f"a family registers under a HF model_type string, got {model_type!r}"])

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, HybridLM)):
            raise ConfigError("model", [f"@register_family('{model_type}') needs a HybridLM subclass, got {cls!r}"])
        config_class = getattr(cls, "config_class", None)
        if not (isinstance(config_class, type) and issubclass(config_class, FamilyConfig)):
            raise ConfigError("model", [f"{cls.__name__}.config_class must be a FamilyConfig subclass"])
        taken = _FAMILIES.get(model_type)
        if taken is not None and taken is not cls and not replace:
            raise ConfigError(
                "model",
                [
                    f"model_type '{model_type}' is already served by {taken.__module__}.{taken.__name__}; pass "
                    "replace=True to swap it on purpose"
                ],
            )
        _FAMILIES[model_type] = cls
        return cls

    return decorate


def _load_entry_points() -> None:
    """Import the plugin modules installed packages declare (once, shared with the cache types' registry); a broken
    one names itself."""
    try:
        cache_registry._load_entry_points()
    except CacheConfigError as e:
        raise ConfigError("model", [str(e)]) from e


def available_families() -> list[str]:
    """Every model_type that from_pretrained can load: in-tree ones and those of installed plugins."""
    _load_entry_points()
    return sorted(set(BUILTIN) | set(_FAMILIES))


def model_class(model_type: str | None) -> type[HybridLM]:
    """The family class registered for `model_type` (importing its in-tree module or the plugins when needed)."""
    if isinstance(model_type, str) and model_type not in _FAMILIES:
        if model_type in BUILTIN:
            importlib.import_module(BUILTIN[model_type])
        else:
            _load_entry_points()
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ConfigError(
            "model", [f"unsupported model_type {model_type!r}; supported: {', '.join(available_families())}"]
        )
    return _FAMILIES[model_type]

"""Production models' configs (configs/production/*.json: published config.json fields, no weights) and their
native cache layers, built by our own family code on the meta device (hybridcache/models/core/meta_build.py).

A config file holds the fields that set the cache's shapes plus what our loader needs, `_model_id` (the model it
describes) and `_unconfirmed` (its numbers no source confirmed; configs/production/README.md says where each came
from). The model is built in the dtype the config names (torch_dtype), so keys, values and conv states are sized
as the model holds them; recurrent states take our Cache's default (float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ROOT / "configs" / "production"

#: Published model types we have no family of our own for, built by a family with the same cache layout: Qwen3.5's
#: MoE text model differs from Qwen3-Next in its projections' layout and its (text-only: plain) MRoPE, neither of
#: which touches the cache (gated_delta conv + delta-rule states, full attention), and reads the same config fields.
SAME_CACHE_AS = {"qwen3_5_moe_text": "qwen3_next"}


class ProductionConfigError(UserError, ValueError):
    """A production config that cannot be used (unknown name, unreadable file, a model type we cannot build)."""


@dataclass(frozen=True)
class Production:
    name: str  # the file's stem
    model_id: str
    model_type: str  # as published
    family: str  # the family that built it
    dtype: torch.dtype
    config: dict[str, Any]
    native: list  # the model's native cache layers (NativeLayer / NativeGroup)
    unconfirmed: tuple[str, ...]


def available(directory: Path = PRODUCTION) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def read(name: str, directory: Path = PRODUCTION) -> dict[str, Any]:
    path = directory / f"{name}.json"
    if not path.is_file():
        raise ProductionConfigError(f"no production config '{name}' in {directory}; known: {', '.join(available())}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProductionConfigError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ProductionConfigError(f"{path}: a config needs a string model_type")
    return config


def build(name: str, directory: Path = PRODUCTION) -> Production:
    """The production model `name`'s native cache layers, from its config through our family code on meta."""
    from hybridcache.models import model_class
    from hybridcache.models.core.family_config import ConfigError
    from hybridcache.models.core.meta_build import empty_model

    config = read(name, directory)
    published = config["model_type"]
    family = SAME_CACHE_AS.get(published, published)
    try:
        cls = model_class(family)
    except ConfigError as e:
        raise ProductionConfigError(f"{name}: {e}") from None
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ProductionConfigError(f"{name}: torch_dtype {config.get('torch_dtype')!r} is not a float dtype")
    typed = cls.config_class.from_hf(config, source=str(directory / f"{name}.json"))
    model, _ = empty_model(lambda: cls(typed))  # parameters on meta: nothing the size of the weights is made
    model = model.to(dtype)
    return Production(
        name=name,
        model_id=str(config.get("_model_id", name)),
        model_type=published,
        family=family,
        dtype=dtype,
        config=config,
        native=model.native_layers(),
        unconfirmed=tuple(config.get("_unconfirmed") or ()),
    )

"""Typed family configs: one dataclass per model family, built from a Hugging Face `config.json` dict.

A family declares its fields with their HF defaults (a field without a default is required) and optional
constraints through `param(...)`:

    @dataclass(kw_only=True)
    class MambaConfig(FamilyConfig):
        family: ClassVar[str] = "mamba"
        state_size: int = param(16, positive=True)

`MambaConfig.from_hf(raw)` checks every field against its declared type (int, float, bool, str, list[...],
dict, unions such as `int | None`) and constraints, then the family's cross-field `problems()`, and raises ONE
`ConfigError` naming the family and every bad field with its value. Keys the dataclass does not declare (HF
configs carry many: architectures, dtype, use_cache, ...) are kept in `extras`, unchecked but for the dtype
(`torch_dtype` / `dtype` must name a torch dtype). `to_dict()` gives the
plain dict that model code indexes (`model.config["hidden_size"]`): the extras overlaid with the typed fields.

`None` for a field that is not Optional means "use the default" (as HF does); a required field that is absent or
None is reported missing. HF's JSON encoding of non-finite floats (`{"__float__": "Infinity"}`) is decoded.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, Union

import torch


class ConfigError(ValueError):
    """A model config that cannot be used: `problems` lists every bad field of `family`."""

    def __init__(self, family: str, problems: list[str], source: str | None = None) -> None:
        self.family, self.problems, self.source = family, list(problems), source
        where = f" ({source})" if source else ""
        super().__init__(f"{family} config{where} is invalid: " + "; ".join(self.problems))


class ArgumentError(ConfigError):
    """Bad arguments to a function that loads a model (from_pretrained): `problems` lists every bad one."""

    def __init__(self, owner: str, problems: list[str]) -> None:
        super().__init__(owner, problems)
        self.args = (f"{owner}: " + "; ".join(self.problems),)


def flag_problems(**flags: Any) -> list[str]:
    """One problem per flag that is not True or False (a string such as "yes" is not a flag)."""
    return [
        f"{name} must be True or False, got {value!r}" for name, value in flags.items() if not isinstance(value, bool)
    ]


def param(
    default: Any = MISSING,
    *,
    positive: bool = False,
    nonnegative: bool = False,
    choices: Any = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A config field: its HF default (none = required), `positive` / `nonnegative` for numbers (and for every
    entry of a list), `choices` allowed for a string (or every entry of a list), `aliases` other HF key names.
    Infinite floats are refused unless the default holds one (time_step_limit's [0, inf])."""
    defaults = default if isinstance(default, (list, tuple)) else [default]
    meta = {
        "positive": positive,
        "nonnegative": nonnegative,
        "choices": tuple(choices) if choices else None,
        "aliases": tuple(aliases),
        "infinite": any(isinstance(v, float) and math.isinf(v) for v in defaults),
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _decode(value: Any) -> Any:
    """HF serializes inf/nan floats as {"__float__": "Infinity"}: turn them back into floats, recursively."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            try:
                return float(value["__float__"])
            except (TypeError, ValueError):
                return value
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_decode(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """Does a JSON value have the declared type? (bool is not an int; an int is a float.)"""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


def _optional(tp: Any) -> bool:
    return tp is Any or (typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """ints given for float fields become floats; lists stay lists (JSON has no tuples)."""
    if tp is float or (
        typing.get_origin(tp) in (Union, types.UnionType)
        and float in typing.get_args(tp)
        and int not in typing.get_args(tp)
    ):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return list(value) if isinstance(value, tuple) else value


def _constraint_problem(name: str, value: Any, meta: Mapping[str, Any]) -> str | None:
    items = value if isinstance(value, list) else [value]
    choices = meta.get("choices")
    if choices:
        bad = [v for v in items if isinstance(v, str) and v not in choices]
        if bad:
            what = "entry" if isinstance(value, list) else "value"
            return f"{name} has unknown {what} {bad[0]!r} (known: {', '.join(choices)})"
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if meta.get("positive") and any(not v > 0 for v in numbers):
        return f"{name} must be positive, got {value!r}"
    if meta.get("nonnegative") and any(not v >= 0 for v in numbers):
        return f"{name} must be >= 0, got {value!r}"
    if any(isinstance(v, float) and math.isnan(v) for v in numbers):
        return f"{name} is NaN"
    if not meta.get("infinite") and any(isinstance(v, float) and math.isinf(v) for v in numbers):
        return f"{name} must be finite, got {value!r}"
    if any(isinstance(v, int) and not -(2**63) <= v < 2**63 for v in numbers):  # torch sizes and ids are int64
        return f"{name} is out of the int64 range, got {value!r}"
    return None


DTYPE_KEYS = ("torch_dtype", "dtype")  # the checkpoint's dtype, as HF config.json writes it (both spellings)


def _dtype_problems(raw: Mapping[str, Any]) -> list[str]:
    """Kept as extras, but checked: null or the name of a torch dtype ("float32", "bfloat16", "torch.float16")."""
    out = []
    for key in DTYPE_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if not name or not isinstance(getattr(torch, name, None), torch.dtype):
            out.append(
                f"{key} must be null or the name of a torch dtype (float32, bfloat16, float16, ...), got {value!r}"
            )
    return out


@dataclass(kw_only=True)
class FamilyConfig:
    """Fields every family has. Subclasses add theirs (with HF defaults) and override `problems()` for checks
    that involve several fields, and `__post_init__` for derived values (HF's own __post_init__)."""

    family: ClassVar[str] = "?"

    vocab_size: int = param(positive=True)
    hidden_size: int = param(positive=True)
    num_hidden_layers: int = param(positive=True)
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        self.extras: dict[str, Any] = {}

    # -- what a family may override ------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Cross-field problems, checked once every field has the right type (empty = fine)."""
        return []

    # -- generic -------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any] | FamilyConfig, family: str | None = None, source: str | None = None
    ) -> FamilyConfig:
        """The typed config of `config` (a HF config.json dict); ConfigError lists every problem found."""
        if isinstance(config, cls):
            return config
        family = family or cls.family
        if isinstance(config, FamilyConfig):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise ConfigError(
                family, [f"the config must be a JSON object (a dict), got {type(config).__name__}"], source
            )
        raw = {str(k): _decode(v) for k, v in config.items()}
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        problems: list[str] = []
        used: set[str] = set()
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            tp, meta = hints[f.name], f.metadata
            keys = [k for k in (f.name, *meta.get("aliases", ())) if k in raw]
            used.update(keys)
            value = raw[keys[0]] if keys else None
            required = f.default is MISSING and f.default_factory is MISSING
            if value is None and not (keys and _optional(tp)):
                if required:
                    problems.append(f"missing required field {f.name} ({_type_name(tp)})")
                continue  # absent, or None for a non-optional field: HF's default
            if not _matches(value, tp):
                problems.append(f"{f.name} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
                continue
            bad = _constraint_problem(f.name, value, meta)
            if bad:
                problems.append(bad)
                continue
            values[f.name] = _coerce(value, tp)
        problems += _dtype_problems(raw)
        if problems:
            raise ConfigError(family, problems, source)
        try:
            typed = cls(**values)
        except (TypeError, ValueError, ZeroDivisionError) as e:  # a derived value that cannot be computed
            raise ConfigError(family, [str(e)], source) from None
        problems = typed.problems()
        if problems:
            raise ConfigError(family, problems, source)
        typed.extras = {k: v for k, v in raw.items() if k not in used}
        return typed

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for model code: the HF keys we do not model (extras) overlaid with the typed fields."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**getattr(self, "extras", {}), **{k: list(v) if isinstance(v, list) else v for k, v in fields.items()}}


def limit_problems(cls: type[FamilyConfig], config: Any, limits: Mapping[str, tuple[int, str]]) -> list[str]:
    """Fields of a raw HF config (under their aliases too, and in a nested text_config) whose int value exceeds
    its limit in `limits` (field name -> (largest allowed value, why)). Checked before `from_hf`, whose derived
    values (a layer list per num_hidden_layers) would otherwise be built first."""
    if not isinstance(config, Mapping):
        return []
    levels = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), Mapping) else [])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name, (limit, why) in limits.items():
        keys = (name, *(fields[name].metadata.get("aliases", ()) if name in fields else ()))
        for raw in levels:
            for key in keys:
                value = raw.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                    out.append(f"{key}={value} exceeds {limit}: {why}")
    return out


def attention_problems(cfg: Any) -> list[str]:
    """Head-count checks shared by the families with attention layers."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = []
    if kv is not None and heads % kv:
        out.append(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    if getattr(cfg, "head_dim", None) is None and cfg.hidden_size % heads:
        out.append(
            f"hidden_size ({cfg.hidden_size}) must be a multiple of num_attention_heads ({heads}) "
            f"when head_dim is not given"
        )
    return out


def length_problem(name: str, values: list | None, layers: int) -> str | None:
    if values is not None and len(values) != layers:
        return f"{name} has {len(values)} entries, num_hidden_layers is {layers}"
    return None

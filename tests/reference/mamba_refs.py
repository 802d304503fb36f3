"""The mamba authors' pure-torch references, importable on a machine without their CUDA builds.

mamba-ssm and causal-conv1d (the `mamba-ref` extra, installed with their CUDA builds skipped: see .ci/run) ship
pure-torch references of their kernels: `selective_scan_ref`, `selective_state_update_ref`, `causal_conv1d_ref`,
`causal_conv1d_update_ref`, `ssd_minimal_discrete` and `ssd_chunk_scan_combined_ref`. Their modules import the CUDA
extensions (`selective_scan_cuda`, `causal_conv1d_cuda`) at top level, so without a CUDA build they do not import.
`load()` imports them with:

- a stub module for each CUDA extension that is not installed (any use of it raises, so a kernel is never called
  silently);
- a bare `mamba_ssm` package (its real `__path__`, without running its `__init__`, which imports the Mamba 1/2/3
  modules, the LM head model and transformers: ~10 s we do not need).

and afterwards puts `sys.modules` back as it was for those names (stubs and every `mamba_ssm*` / `causal_conv1d*`
module imported here are removed), so later imports, e.g. hybridcache's CUDA dispatch, see the genuine packages or a
genuine ImportError. The functions keep working: they hold their own module globals. Test code only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

PACKAGES = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}  # import name -> distribution name
CUDA_EXTENSIONS = ("selective_scan_cuda", "causal_conv1d_cuda")
INSTALL = (
    "MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "
    "CAUSAL_CONV1D_FORCE_BUILD=TRUE pip install --no-build-isolation -e '.[mamba-ref]'"
)


@dataclass(frozen=True)
class Refs:
    selective_scan_ref: Callable
    selective_state_update_ref: Callable
    causal_conv1d_ref: Callable
    causal_conv1d_update_ref: Callable
    ssd_minimal_discrete: Callable
    ssd_chunk_scan_combined_ref: Callable
    versions: str  # "mamba-ssm X, causal-conv1d Y"
    stubbed: tuple[str, ...]  # the CUDA extensions replaced by stubs (empty where the CUDA builds are installed)


def missing() -> str | None:
    """Why the references cannot be imported here (a skip reason), or None when both packages are installed."""
    absent = [dist for name, dist in PACKAGES.items() if importlib.util.find_spec(name) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (the mamba-ref extra): {INSTALL}"
    return None


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__doc__ = f"stub for the CUDA extension {name} (not built here): tests/reference/mamba_refs.py"

    def __getattr__(attr: str):  # AttributeError, as hasattr / inspect expect
        raise AttributeError(
            f"{name}.{attr}: {name} is a stub (its CUDA build was skipped); only the pure-torch "
            "references may be called"
        )

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


def _bare_package(name: str) -> types.ModuleType:
    spec = importlib.util.find_spec(name)
    mod = types.ModuleType(name)
    mod.__path__ = list(spec.submodule_search_locations)  # submodules import; the package __init__ does not run
    mod.__file__ = spec.origin
    return mod


@functools.cache
def load() -> Refs:
    """The references (see the module docstring). Raises ImportError when a package is missing (see `missing`)."""
    reason = missing()
    if reason:
        raise ImportError(reason)
    ours = lambda key: key in CUDA_EXTENSIONS or key.split(".")[0] in PACKAGES
    saved = {key: mod for key, mod in sys.modules.items() if ours(key)}
    stubbed = tuple(n for n in CUDA_EXTENSIONS if importlib.util.find_spec(n) is None)
    try:
        for name in stubbed:
            sys.modules[name] = _stub(name)
        sys.modules["mamba_ssm"] = _bare_package("mamba_ssm")
        ssi = importlib.import_module("mamba_ssm.ops.selective_scan_interface")
        ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
        ssd_min = importlib.import_module("mamba_ssm.modules.ssd_minimal")
        ssd_comb = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        conv = importlib.import_module("causal_conv1d.causal_conv1d_interface")
    finally:
        for key in [k for k in sys.modules if ours(k)]:
            del sys.modules[key]
        sys.modules.update(saved)
    versions = ", ".join(f"{dist} {importlib.metadata.version(dist)}" for dist in PACKAGES.values())
    return Refs(
        ssi.selective_scan_ref,
        ssu.selective_state_update_ref,
        conv.causal_conv1d_ref,
        conv.causal_conv1d_update_ref,
        ssd_min.ssd_minimal_discrete,
        ssd_comb.ssd_chunk_scan_combined_ref,
        versions,
        stubbed,
    )

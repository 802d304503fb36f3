"""Loading the C decode kernels (csrc/cpu_decode.c and the op-family files it includes): build or find the verified
library once per process, set every function's ctypes signature from the one declaration (op_declarations.SIGNATURES),
and
say which path runs.

See kernels.py for what the kernels do and when they run; build.py for how a library is built and verified.
"""

from __future__ import annotations

import ctypes
import threading

from hybridcache.accel.native.build import SOURCE_DIR as _SOURCE_DIR
from hybridcache.accel.native.build import load_library
from hybridcache.accel.native.op_declarations import SIGNATURES
from hybridcache.ops._dispatch import kernels_disabled

SOURCE = _SOURCE_DIR / "cpu_decode.c"  # compiled; every .c / .h beside it is part of the build
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "status": a line saying which path runs


def _load() -> ctypes.CDLL | None:
    loaded, reason = load_library("cpu_decode", SOURCE, list(SIGNATURES), disabled=kernels_disabled())
    if loaded is None:
        _state["status"] = f"torch path: {reason}"
        return None
    lib = loaded.lib
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    threads = f"OpenMP, {lib.hc_threads()} threads" if lib.hc_openmp() else "one thread (no OpenMP)"
    note = f"; {loaded.note}" if loaded.note else ""
    _state["status"] = (
        f"C kernels: {lib.hc_isa().decode()}, {threads}, {loaded.file} (sha256-verified, built by "
        f"{loaded.compiler}){note}"
    )
    return lib


def _library() -> ctypes.CDLL | None:
    lib = _state.get("lib", _state)  # the hot path: one dict lookup once loaded
    if lib is not _state:
        return lib  # type: ignore[return-value]
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def kernel_available() -> bool:
    """Whether the kernels are built and loaded here (builds them on first call)."""
    return _library() is not None


def kernel_status() -> str:
    """One line naming the path that runs: "C kernels: <isa>, <threads>, <library> ..." or "torch path: <why>"
    (builds and verifies the kernels if needed)."""
    _library()
    return str(_state["status"])


def _reset() -> None:
    """Forget the loaded library (tests): the next call loads again, by the rules above."""
    with _lock:
        _state.clear()

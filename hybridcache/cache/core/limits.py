"""Limits checked before anything is allocated: whether a device can be used, and whether an estimated number of
bytes fits in the memory its device has available (so a request for 10**12 rows is an error, not a killed process).

Estimates are lower bounds (the bytes a cache's specs say it holds, index tensors, token buffers): a request they
refuse could never have run; one they accept may still run out of memory later, as any allocation may.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError, CacheMemoryError

_ALWAYS_FITS = 64 << 20
ROW_BOOKKEEPING = 16  # bytes per row of a cache's sequence state: real-token count and token fingerprint (int64)


def device_problem(device: Any) -> str | None:
    """None when `device` names a device this process can allocate on, else what is wrong with it (no CUDA in
    this torch build or no GPU visible, an index past the device count, a name torch does not know)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"device {device!r} is not a device torch knows ({str(e).splitlines()[0]})"
    if dev.type in ("cpu", "meta"):
        return None
    try:
        torch.empty(0, device=dev)
    except Exception as e:  # AssertionError (torch without CUDA), RuntimeError (bad ordinal, no driver), ...
        first = (str(e).splitlines() or [type(e).__name__])[0]
        available = "available" if getattr(torch, dev.type, None) and _is_available(dev.type) else "not available"
        return f"device {str(dev)!r} cannot be used here ({dev.type} is {available} in this process: {first})"
    return None


def _is_available(kind: str) -> bool:
    module = getattr(torch, kind, None)
    try:
        return bool(module.is_available()) if module is not None and hasattr(module, "is_available") else False
    except Exception:  # noqa: BLE001 - a backend that cannot even say
        return False


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, when it has one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def _host_available() -> int | None:
    """MemAvailable (Linux), else free physical pages (POSIX), bounded by the cgroup's limit; None when unknown."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    cgroup = _cgroup_free()
    if cgroup is not None:
        found = cgroup if found is None else min(found, cgroup)
    return found


def available_bytes(device: Any) -> int | None:
    """Bytes that can still be allocated on `device`; None when not known (then nothing is refused). CPU: the
    host's available memory; CUDA: the device's free memory plus what torch's allocator holds unused; meta: None."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return _host_available()
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free) + int(torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    return None


def format_nbytes(n: int) -> str:
    if n >= 1 << 60:
        return f"{n:.3g} B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def check_fits(nbytes: int, device: Any, what: str, hint: str = "") -> None:
    """Raise `CacheMemoryError` when `nbytes` (an estimate made before allocating) exceed what `device` has
    available; changes nothing. `what` says what needs them, `hint` how to ask for less."""
    if nbytes <= _ALWAYS_FITS:  # what any machine running this has: no system call on the hot paths
        return
    available = available_bytes(device)
    if available is None or nbytes <= available:
        return
    raise CacheMemoryError(
        f"{what} needs at least {format_nbytes(nbytes)} on {torch.device(device)}, but only "
        f"{format_nbytes(available)} is available; nothing was allocated" + (f" ({hint})" if hint else "")
    )


def check_new_cache(plan: Any, batch_size: int, device: Any) -> None:
    """Before a cache of `batch_size` rows is allocated from `plan`: the device can be used, and the rows' bytes
    (what the plan's specs hold empty: preallocated storage, recurrent states) fit."""
    problem = device_problem(device)
    if problem:
        raise CacheError(f"Cache: {problem}")
    check_fits(batch_size * (plan.held_nbytes(1, 0) + ROW_BOOKKEEPING), device, f"a cache of {batch_size} rows")


def check_rows_fit(cache: Any, rows: int, what: str) -> None:
    """Before a batch operation of `cache` to `rows` rows (repeat, a growing select): their bytes fit (each row
    as the cache holds them now, with its sequence state and fingerprint history, plus the row index itself)."""
    held = cache.nbytes() + cache.spare_nbytes()
    per_row = -(-held // cache.batch_size) + ROW_BOOKKEEPING + 8 * cache.columns + 8
    check_fits(
        rows * per_row,
        cache.device,
        f"Cache.{what} to {rows} rows ({cache.batch_size} now)",
        "fewer rows, or a smaller cache per row",
    )

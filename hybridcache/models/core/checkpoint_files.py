"""Where a Hugging Face checkpoint is and what it holds: the directory (or hub download), config.json, the
safetensors headers (names, shapes, dtypes; sharded too) and the tensors, read without memory-mapping. Every file
must be inside the checkpoint directory (links out and `..` shard names are refused) and a regular file: a FIFO,
device, socket or directory under a checkpoint file's name is refused by name before it is opened for reading (a FIFO
would block the open forever)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt"]
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
MAX_JSON_BYTES = 64 << 20  # config.json is a few KB, the index of a 1T-parameter checkpoint a few MB


class CheckpointError(ValueError):
    """A checkpoint directory whose files cannot be used as they are (the message names the file or tensor)."""


# -- where the checkpoint is --------------------------------------------------------------------------------------
def looks_like_path(path_or_id: str | Path) -> bool:
    """A local path rather than a hub id ("org/name" or "name"): a Path, a leading / . ~, a backslash, more than
    one "/", characters a hub id cannot have, or a first component that exists here."""
    if isinstance(path_or_id, Path):
        return True
    s = str(path_or_id)
    if s.startswith(("/", ".", "~")) or "\\" in s or s.count("/") > 1 or not HUB_ID.match(s):
        return True
    return "/" in s and Path(s.split("/", 1)[0]).exists()


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local checkpoint directory, or a hub id downloaded (safetensors only) where the hub is reachable."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the checkpoint directory that holds config.json")
    if looks_like_path(path_or_id):
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        hint = f" (the nearest existing folder is {parent})" if parent is not None and parent != Path("/") else ""
        raise FileNotFoundError(f"checkpoint directory '{path_or_id}' does not exist{hint}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), allow_patterns=CHECKPOINT_FILES))
    except Exception as e:  # offline, unknown repo, no permission: one clear message
        raise FileNotFoundError(
            f"'{path_or_id}' is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; invalid JSON names the file, line and column."""
    with open_regular(file, str(file)) as handle:
        data = handle.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{file} is larger than {MAX_JSON_BYTES >> 20} MiB, more than any JSON file of a checkpoint"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise CheckpointError(f"{file}: JSON nested too deeply to read") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} must hold a JSON object, it holds a JSON {type(value).__name__}")
    return value


# -- reading only regular files -----------------------------------------------------------------------------------
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the file is."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, what: str) -> Path:
    """`path` (links followed: check_inside judges where they lead) when it is a regular file; a FIFO, device,
    socket or directory is a CheckpointError naming `what`, a missing file a FileNotFoundError naming it."""
    try:
        kind = _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} does not exist") from None
    except OSError as e:  # a link loop, no permission, a name too long
        raise CheckpointError(f"{what} cannot be read ({e.strerror or type(e).__name__})") from None
    if kind:
        raise CheckpointError(f"{what} is {kind}, not a regular file; checkpoint files must be regular files")
    return path


def open_regular(path: Path, what: str) -> BinaryIO:
    """`path` opened for reading, once it is a regular file: checked by name first, then opened with O_NONBLOCK (a
    FIFO put there since cannot block the open) and checked again on the descriptor, so the file read is the file
    checked."""
    check_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{what} cannot be opened ({e.strerror or type(e).__name__})") from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind:
            raise CheckpointError(f"{what} is {kind}, not a regular file (it changed while being opened)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def descriptor_path(handle: BinaryIO, path: Path) -> str:
    """A name that opens the very file `handle` has open (/proc/self/fd/N, /dev/fd/N) for libraries that take a path
    (safetensors' safe_open): whatever is put at `path` meanwhile, they read the checked file; `path` where the
    system has neither."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{handle.fileno()}"
    return str(path)


def read_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{directory} has no config.json")
    return read_json_object(check_inside(directory, file, "config.json"))


# -- what the checkpoint holds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # a torch dtype, or the safetensors name of one torch cannot hold


def shard_path(directory: Path, shard: Any, index: Path) -> Path:
    """`directory / shard`, refusing names that leave the checkpoint directory (absolute, `..`) or links out."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map values must be shard file names, got {shard!r}")
    inside = os.path.normpath(os.path.join(directory, shard))
    if (
        os.path.isabs(shard)
        or shard.startswith(("/", "\\"))
        or "\\" in shard
        or ".." in Path(shard).parts
        or os.path.commonpath([inside, os.path.normpath(directory)]) != os.path.normpath(directory)
    ):
        raise CheckpointError(
            f"{index}: shard path {shard!r} points outside the checkpoint directory {directory}; "
            "shards must be relative file names inside it"
        )
    path = Path(inside)
    if not path.exists():
        raise FileNotFoundError(f"{directory}: shard {shard} listed in {index.name} is missing")
    return check_regular(check_inside(directory, path, f"{index}: shard {shard!r}"), f"{index}: shard {shard!r}")


def check_inside(directory: Path, path: Path, what: str) -> Path:
    """`path`, once its real path (links resolved) is inside the directory's real path, or, for a hub snapshot
    (`.../snapshots/<rev>/`, files linked to `../../blobs/`), in its blobs folder: a link elsewhere is refused."""
    root = os.path.realpath(directory)
    roots = [root] + (
        [os.path.join(os.path.dirname(os.path.dirname(root)), "blobs")]
        if os.path.basename(os.path.dirname(root)) == "snapshots"
        else []
    )
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise CheckpointError(
            f"{what} is a symbolic link to {real}, outside the checkpoint directory {root}; "
            "checkpoint files must be inside it"
        )
    return path


def checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files to read and, for a sharded checkpoint, the index's tensor -> shard map."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(check_inside(directory, index, f"{directory}: {INDEX_FILE}")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file")
        where = {name: shard_path(directory, shard, index) for name, shard in weight_map.items()}
        return sorted(set(where.values())), where
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{directory} has no model.safetensors (or sharded index); only safetensors are read")
    what = f"{directory}: model.safetensors"
    return [check_regular(check_inside(directory, single, what), what)], {}


def read_header(files: list[Path], weight_map: Mapping[str, Path] | None = None) -> dict[str, TensorInfo]:
    """Name, shape and dtype of every tensor from the safetensors headers: nothing is loaded."""
    infos: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with (
                open_regular(file, str(file)) as held,
                safe_open(descriptor_path(held, file), framework="pt") as handle,
            ):
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    if name in infos:
                        raise CheckpointError(
                            f"tensor {name} is stored twice: in {infos[name].file.name} and {file.name}"
                        )
                    dtype = sl.get_dtype()
                    infos[name] = TensorInfo(file, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype))
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' own errors for truncated or corrupt files
            raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    for name, file in (weight_map or {}).items():
        if name not in infos or infos[name].file != file:
            raise CheckpointError(f"{INDEX_FILE} lists tensor {name} in {file.name}, which does not hold it")
    return infos


def _data_offsets(file: Path, handle: Any, length: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the data starts in a safetensors file, and each tensor's [begin, end) byte range after it."""
    (size,) = struct.unpack("<Q", handle.read(8))
    if size > length - 8:  # the file changed since its header was checked
        raise CheckpointError(f"{file}: header length {size} exceeds the file ({length} bytes)")
    header = json.loads(handle.read(size))
    return 8 + size, {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def read_tensors(infos: Mapping[str, TensorInfo], names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load the named tensors (all when None), one file open at a time, each read straight into its own memory.

    Not memory-mapped: weights in file-backed pages stream ~40% slower in a decode step (measured on Gemma 3
    270M's 671 MB head: 32 ms vs 22.5 ms a read), and copying them out of a mapping would hold the file's pages and
    the copies at once (twice the model in peak memory)."""
    wanted = list(infos) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(infos[name].file, []).append(name)
    state = {}
    for file, names_in_file in by_file.items():
        with open_regular(file, str(file)) as handle:
            length = os.fstat(handle.fileno()).st_size
            start, offsets = _data_offsets(file, handle, length)
            for name in names_in_file:
                info = infos[name]
                if not isinstance(info.dtype, torch.dtype):
                    raise CheckpointError(f"{file}: tensor {name} has dtype {info.dtype}, which torch cannot hold")
                begin, end = offsets[name]
                tensor = torch.empty(info.shape, dtype=info.dtype)
                raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)
                if end - begin != raw.numel() or start + end > length:
                    raise CheckpointError(
                        f"{file}: tensor {name} has {end - begin} bytes at [{begin}, {end}), "
                        f"expected {raw.numel()} within the file ({length} bytes)"
                    )
                handle.seek(start + begin)
                if raw.numel() and handle.readinto(memoryview(raw.numpy())) != raw.numel():
                    raise CheckpointError(f"{file}: tensor {name} is cut short (truncated file?)")
                state[name] = tensor
    return state

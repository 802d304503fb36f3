"""Who a saved cache belongs to: the model's family, a sha256 of its config and of every byte of its weights."""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Mapping

import torch

from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.tensor_bytes import byte_view

# -- the model's identity -------------------------------------------------------------------------------------
# model -> (stamp, digest): hashing every byte of a 270M model takes ~0.5 s, so it is done once per model object
# and again only when the stamp (each tensor's address, shape, dtype, version counter) changes.
_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def _weights_stamp(state: Mapping[str, torch.Tensor]) -> tuple | None:
    """What changes when a tensor is replaced or edited in place (None: not trackable, hash every time)."""
    try:
        return tuple(
            (n, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t._version)
            for n, t in state.items()
        )
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of every tensor of `model.state_dict()`: name, shape, dtype and every byte (a tensor that shares the
    memory of an earlier one, e.g. a tied head, is recorded as that alias instead of being hashed twice)."""
    state = model.state_dict(keep_vars=True)
    stamp = _weights_stamp(state)
    cached = _WEIGHTS.get(model)
    if stamp is not None and cached is not None and cached[0] == stamp:
        return cached[1]
    h, first = hashlib.sha256(), {}
    for name, t in sorted(state.items()):
        t = t.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        if t.is_meta:
            raise CacheError(f"the model's tensor {name} is on the meta device (not loaded): it has no identity")
        alias = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.stride()),
            tuple(t.shape),
            t.dtype,
            str(t.device),
        )
        if t.numel() and alias in first:
            h.update(f"=alias of {first[alias]}|".encode())
            continue
        first[alias] = name
        if t.numel():  # a byte view of the tensor itself: no copy for a contiguous CPU tensor (bf16 included)
            h.update(byte_view(t))
    digest = h.hexdigest()
    if stamp is not None:
        _WEIGHTS[model] = (stamp, digest)
    return digest


def forget_model_identity(model: torch.nn.Module) -> None:
    """Drop the remembered weights digest: needed only after edits the version counters miss (`p.data[...] = x`,
    writes through a numpy view)."""
    _WEIGHTS.pop(model, None)


def model_identity(model: torch.nn.Module) -> dict[str, str]:
    """Who a cache belongs to: the family, a sha256 of its config, a sha256 of every byte of its weights."""
    config = json.dumps(getattr(model, "config", {}), sort_keys=True, default=str)
    return {
        "family": str(getattr(model, "family", type(model).__name__)),
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "weights_sha256": weights_sha256(model),
    }

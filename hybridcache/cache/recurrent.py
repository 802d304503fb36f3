"""Recurrent cache layers: `mamba`, `mamba2`, `rglru`, `conv`.

Each holds named fixed-shape state tensors [B, ...] that its mixer reads (`layer.states`) and replaces with
`layer.update(**new_states)` (staged until the block commits, so a failed forward leaves the old states). A convolution state keeps the last K-1 inputs of a width-K causal conv (the
minimum); SSM / LRU states are float32 unless the config sets `state_dtype`. They keep only the latest state, so
`crop` cannot rewind them: roll back with `Cache.snapshot()` / `Cache.restore()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.base import CacheLayer, LayerSpec, check_float_dtype, check_positive_int, dtype_nbytes, tunable
from hybridcache.cache.errors import CacheCropError, CacheError
from hybridcache.cache.registry import register_cache_layer


@dataclass(frozen=True, kw_only=True)
class RecurrentSpec(LayerSpec):
    """Base of recurrent specs: `state_shapes()` names every state tensor (shape without batch, dtype)."""

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _check(self, *names: str) -> None:
        for name in names:
            check_positive_int(type(self).__name__, name, getattr(self, name))

    def min_nbytes(self, batch: int, tokens: int) -> int:
        per_row = sum(math.prod(shape) * dtype_nbytes(dt) for shape, dt in self.state_shapes().values())
        return batch * per_row


@dataclass(frozen=True, kw_only=True)
class MambaSpec(RecurrentSpec):
    """Mamba1: conv state [D_inner, K-1] and SSM state [D_inner, N]."""

    intermediate_size: int
    state_size: int
    conv_kernel: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("intermediate_size", "state_size", "conv_kernel")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        return {
            "conv": ((self.intermediate_size, self.conv_kernel - 1), self.dtype),
            "ssm": ((self.intermediate_size, self.state_size), self.state_dtype),
        }


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec(RecurrentSpec):
    """Mamba2: conv state over x, B, C [H*P + 2*G*N, K-1] and SSM state [H, P, N]."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        conv_dim = self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size
        return {
            "conv": ((conv_dim, self.conv_kernel - 1), self.dtype),
            "ssm": ((self.num_heads, self.head_dim, self.state_size), self.state_dtype),
        }


@dataclass(frozen=True, kw_only=True)
class RGLRUSpec(RecurrentSpec):
    """RecurrentGemma's recurrent block: conv state [W, K-1] and RG-LRU state [W] (float32)."""

    lru_width: int
    conv_kernel: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("lru_width", "conv_kernel")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        return {
            "conv": ((self.lru_width, self.conv_kernel - 1), self.dtype),
            "lru": ((self.lru_width,), self.state_dtype),
        }


@dataclass(frozen=True, kw_only=True)
class ConvSpec(RecurrentSpec):
    """A short causal convolution (LFM2-style): conv state [C, K-1] only."""

    channels: int
    conv_kernel: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("channels", "conv_kernel")

    def state_shapes(self):
        return {"conv": ((self.channels, self.conv_kernel - 1), self.dtype)}


class RecurrentCacheLayer(CacheLayer):
    """Fixed-shape named states; the mixer reads `states` and writes them back with `update`."""

    kind = "recurrent"
    spec_cls = RecurrentSpec
    spec: RecurrentSpec

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.spec.state_shapes())

    def _allocate(self, batch_size: int) -> None:
        for name, (shape, dtype) in self.spec.state_shapes().items():
            setattr(self, name, torch.zeros((batch_size, *shape), dtype=dtype, device=self.device))

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The current states by name, e.g. {"conv": [B, C, K-1], "ssm": [B, D, N]}."""
        return {name: getattr(self, name) for name in self._batch_tensors}

    def update(self, valid: torch.Tensor | int | None = None, **new_states: torch.Tensor) -> None:
        """Replace every state after a block. Inside a Cache the block was opened by the Cache; a standalone layer
        takes the block's real-token mask [B, T] or its length T as `valid`."""
        expected = self.spec.state_shapes()
        if set(new_states) != set(expected):
            raise CacheError(f"{self.name}: update needs exactly the states {sorted(expected)}, got {sorted(new_states)}")
        for name, (shape, dtype) in expected.items():
            t = new_states[name]
            want = (self.batch_size, *shape)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CacheError(f"{self.name}: state '{name}' must have shape {want}, got {got}")
            if t.dtype != dtype:
                raise CacheError(f"{self.name}: state '{name}' must have dtype {dtype}, got {t.dtype}")
            if t.device != self.device:
                raise CacheError(f"{self.name}: state '{name}' is on {t.device}, the layer is on {self.device}")
        if self.seq.block is not None:
            tokens = self.seq.block.tokens
        elif isinstance(valid, int) and not isinstance(valid, bool):
            tokens, valid = valid, None
        elif isinstance(valid, torch.Tensor) and valid.dim() == 2:
            tokens = valid.shape[1]
        else:
            raise CacheError(f"{self.name}: valid must be a real-token mask [B, T] or a token count, got {valid!r}")
        _, opened = self._open(valid, tokens)
        self._staged = new_states
        self._close(opened, failed=False)

    def _commit_staged(self, staged: dict[str, torch.Tensor]) -> None:
        for name, t in staged.items():
            getattr(self, name).copy_(t)

    def _prepare_crop(self, n: int, seen: torch.Tensor) -> int:
        if n != self.columns:
            raise CacheCropError(
                f"{self.name}: keeps only its latest state, so crop({n}) cannot rewind it from {self.columns} "
                "tokens. Rollback of recurrent layers works from a checkpoint: take snap = cache.snapshot() "
                "at the point you may return to, then cache.restore(snap)."
            )
        return n

    def _commit_crop(self, plan: int) -> None:
        pass  # only a crop to the current length passes validation


@register_cache_layer("mamba")
class MambaStateLayer(RecurrentCacheLayer):
    """Mamba1 conv + selective-scan state."""

    spec_cls = MambaSpec
    example_native = {"intermediate_size": 6, "state_size": 3, "conv_kernel": 4}


@register_cache_layer("mamba2")
class Mamba2StateLayer(RecurrentCacheLayer):
    """Mamba2 conv + SSD state (heads x head_dim x d_state)."""

    spec_cls = Mamba2Spec
    example_native = {"num_heads": 2, "head_dim": 3, "state_size": 4, "n_groups": 1, "conv_kernel": 4}


@register_cache_layer("rglru")
class RGLRUStateLayer(RecurrentCacheLayer):
    """RecurrentGemma conv + RG-LRU state."""

    spec_cls = RGLRUSpec
    example_native = {"lru_width": 5, "conv_kernel": 4}


@register_cache_layer("conv")
class ConvStateLayer(RecurrentCacheLayer):
    """Short-convolution state only (LFM2-style)."""

    spec_cls = ConvSpec
    example_native = {"channels": 5, "conv_kernel": 3}

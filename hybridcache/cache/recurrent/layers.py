"""Recurrent cache layers: `mamba`, `mamba2`, `rglru`, `conv`.

Each holds named fixed-shape state tensors [B, ...] that its mixer reads (`layer.states`) and replaces with
`layer.update(**new_states)` (staged until the block commits, so a failed forward leaves the old states). A
convolution state keeps the last K-1 inputs of a width-K causal conv (the minimum); SSM / LRU states are float32
unless the config sets `state_dtype`.

Rollback: by default a layer keeps only its latest state, so `crop` cannot rewind it (roll back with
`Cache.snapshot()` / `Cache.restore()`). With `rollback: k` (a tunable of every recurrent type,
`{"recurrent": {"rollback": 4}}`) it also keeps the states after each of the last k columns (`<name>_trail`
[B, k, ...], `trail_columns` [k]): the state before a block is kept by the layer itself, and a mixer hands over the
states after the block's interior tokens (`update(..., trail={name: [B, m, ...]})`, m = `trail_length(T)`), so
`crop(n)` is exact for any n within the last k columns, across blocks and decode steps (speculative decoding).

Storage (state_codecs.py, state_layout.py, state_offload.py): `state_dtype` is the float dtype the mixer reads and
hands back (its exchange and compute format); `state_codec` is how the layer holds the state between blocks (`dense`:
as is; `bfloat16`, fp8, `int8`, `int4`, ... with `state_group` choosing the scale axis). The state is re-encoded
after every block, so a lossy codec's error accumulates over a generation. The conv state is held dense unless
`quantize_conv: true`: it is K-1 raw inputs per channel (a few % of a layer's state bytes next to an SSM state of N
columns), it is not an accumulator whose error matters less, and a `conv`-only layer (LFM2) then keeps its exact
default under a kind-wide `recurrent: {state_codec: ...}`. `offload: true` keeps the held parts off the compute
device between blocks. Checkpoint trails, snapshots and saved files hold the encoded parts as they are.

Remedies for the drift of re-encoded states (state_layout.py, docs/state_drift.md): `rounding: stochastic`
(unbiased rounding, uniforms seeded by `rounding_seed` and keyed by column) and `error_feedback: true` (the
quantization residual is held as one more part, in `error_codec`, and added back before the next encode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.core.base import CacheLayer, LayerSpec, check_float_dtype, check_positive_int, tunable
from hybridcache.cache.core.errors import CacheCropError, CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.recurrent.codecs import ROUNDINGS, DenseStateCodec, get_state_codec
from hybridcache.cache.recurrent.layout import StateLayout
from hybridcache.cache.recurrent.offload import state_tier
from hybridcache.cache.recurrent.run_states import ReservedStates


@dataclass
class StateWrite:
    """What `update` stages for the open block: the states after it, and (rollback on) the trail before them."""

    states: dict[str, torch.Tensor]  # name -> [B, ...]
    trail: dict[str, torch.Tensor] | None  # name -> [B, m, ...] the states after each of the block's last m tokens


@dataclass(frozen=True, kw_only=True)
class RecurrentSpec(LayerSpec):
    """Base of recurrent specs: `state_shapes()` names every state tensor (shape without batch, dtype)."""

    rollback: int = tunable(0)  # keep the states after each of the last k columns, so crop(n) can rewind k
    state_codec: str = tunable("dense")  # how states are held between blocks (state_codecs.py)
    state_group: str = tunable("channel")  # scale axis of scaled codecs: "channel" (last axis) or "head" (first)
    quantize_conv: bool = tunable(False)  # the codec also holds the conv state (else: dense)
    offload: bool = tunable(False)  # held parts off the compute device between blocks (state_offload.py)
    rounding: str = tunable("nearest")  # "nearest" or "stochastic" (unbiased; state_codecs.py)
    rounding_seed: int = tunable(0)  # seed of stochastic rounding's uniforms (state_layout.py)
    error_feedback: bool = tunable(False)  # hold the quantization residual and add it back before the next encode
    error_codec: str | None = tunable(None)  # how that residual is held (None: dense, the state's dtype)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner, k = type(self).__name__, self.rollback
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CacheError(f"{owner}: rollback must be an integer >= 0, got {k!r}")
        codec = get_state_codec(self.state_codec, self.state_group)  # unknown names fail here, with the known ones
        for name in ("quantize_conv", "offload", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise CacheError(f"{owner}: {name} must be true or false, got {getattr(self, name)!r}")
        self._check_remedies(owner, codec)

    def _check_remedies(self, owner: str, codec: Any) -> None:
        """rounding / rounding_seed / error_feedback / error_codec: valid values, and only with a codec they
        change (a remedy that cannot do anything is a mistake in the config, not a silent no-op)."""
        if self.rounding not in ROUNDINGS:
            raise CacheError(f"{owner}: rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        seed = self.rounding_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise CacheError(f"{owner}: rounding_seed must be an integer in [0, 2^63), got {seed!r}")
        if self.rounding == "stochastic" and not codec.rounds:
            raise CacheError(
                f"{owner}: rounding: stochastic needs a state_codec that rounds (bfloat16, float16, float8_*, int8, "
                f"int4); state_codec {self.state_codec} does not"
            )
        if self.error_codec is not None:
            if not self.error_feedback:
                raise CacheError(f"{owner}: error_codec only applies with error_feedback: true")
            get_state_codec(self.error_codec, self.state_group)  # unknown names fail with the known ones
            if self.error_codec == "zero":
                raise CacheError(f"{owner}: error_codec zero drops the residual (that is error_feedback: false)")
        if self.error_feedback and not codec.rounds:
            raise CacheError(
                f"{owner}: error_feedback needs a lossy state_codec (bfloat16, float16, float8_*, int8, int4); "
                f"state_codec {self.state_codec} has no rounding error to feed back"
            )

    def layout(self) -> StateLayout:
        """Codecs and stored parts of the states (built once per spec)."""
        if "_layout" not in self.__dict__:
            object.__setattr__(self, "_layout", StateLayout(self))
        return self.__dict__["_layout"]

    @property
    def exact_storage(self) -> bool:
        """Whether the codec gives the states back bit for bit."""
        return self.layout().exact

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _check(self, *names: str) -> None:
        for name in names:
            check_positive_int(type(self).__name__, name, getattr(self, name))

    def min_nbytes(self, batch: int, tokens: int) -> int:
        """Bytes held: every state's stored parts (codes + scales + error-feedback residuals), plus the kept
        trail (`rollback: k`: k more copies)."""
        return batch * self.layout().row_nbytes() * (1 + self.rollback)


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
    """A short causal convolution (LFM2-style): conv state [C, K-1] only, in `state_dtype` (None: the model
    dtype; the state holds past conv inputs, so a wider dtype only costs memory). Accepting `state_dtype` lets a
    `recurrent: {state_dtype: ...}` config apply to every recurrent type."""

    channels: int
    conv_kernel: int
    state_dtype: torch.dtype | None = tunable(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("channels", "conv_kernel")
        if self.state_dtype is not None:
            check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        return {"conv": ((self.channels, self.conv_kernel - 1), self.state_dtype or self.dtype)}


class RecurrentCacheLayer(CacheLayer):
    """Fixed-shape named states; the mixer reads `states` and writes them back with `update`."""

    kind = "recurrent"
    spec_cls = RecurrentSpec
    spec: RecurrentSpec

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._parts

    @property
    def _other_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("trail_columns",) if self.spec.rollback else ()

    def _allocate(self, batch_size: int) -> None:
        k, self.layout = self.spec.rollback, self.spec.layout()
        held = self.layout.allocate(batch_size, (), self.device)
        if k:
            held.update({f"{a}_trail": t for a, t in self.layout.allocate(batch_size, (k,), self.device).items()})
            self.trail_columns = torch.full((k,), -1, dtype=torch.long, device=self.device)  # [k], -1: empty
        for attr, t in held.items():
            setattr(self, attr, t)
        self._parts = tuple(held)  # every stored attribute, trails included
        self._tier = state_tier(self)  # None: the parts stay on self.device
        self._park()

    def _held(self) -> dict[str, torch.Tensor]:
        return {attr: getattr(self, attr) for attr in self.layout.attrs}

    @property
    def is_exact(self) -> bool:
        return self.exact and self.layout.exact

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The current states by name, decoded to the spec's dtypes, e.g. {"conv": [B, C, K-1], "ssm": [B, D, N]}
        (for dense storage, the held tensors themselves)."""
        self._fetch()
        held = self._held()
        if self._tier is not None:
            self._tier.release()  # nothing changed: the parked parts stay as they are
        return {name: self.layout.decode(held, name) for name in self.layout.shapes}

    def round_trip(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The states this layer gives back after `update(**states)` (the codec's encode then decode)."""
        return self.layout.round_trip(states)

    def trail_length(self, tokens: int) -> int:
        """How many interior states of a block of `tokens` a mixer hands over: the states after each of its last
        m = min(checkpoints, tokens - 1) tokens before the final one (0 when checkpoints are off)."""
        return min(self.spec.rollback, tokens - 1)

    # -- decode runs (accel/runs/decode_run.py): many one-token steps committed as one block -------------------------
    # The run's kernels read and write the states in buffers of their own (run_states.py), never in what the layer
    # holds; `decode_block` then stages the run's last states (and, with rollback, the trail of the steps before)
    # as one block of n tokens, which commits exactly as n one-token blocks would: the held states are the states
    # themselves (a dense codec, float32, on the device: no encode that a split into blocks could change) and the
    # trail keeps the same columns. Anything else declines (step by step).
    def reserve_slots(self, tokens: int) -> ReservedStates | None:
        """Buffers for a decode run of up to `tokens` one-token steps (run_states.py), the held states copied into
        the ring's last buffer; None (nothing changed) where n one-token blocks could differ from one block of n
        (a codec other than dense, a state that is not float32, offload), a block is open or tokens < 1."""
        layout = self.layout
        if (
            self.seq.block is not None
            or self._staged is not None
            or isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or tokens < 1
            or self._tier is not None
            or layout.feedback
            or any(type(c) is not DenseStateCodec for c in layout.codecs.values())
            or any(dtype != torch.float32 for _, dtype in layout.shapes.values())
        ):
            return None
        size = max(2, self.spec.rollback + 1)  # a trail of m <= k steps and the last: k + 1 buffers
        held = self._held()
        rings = {}
        for name in layout.shapes:
            t = held[name]  # [B, ...] (dense: the state itself)
            ring = rings[name] = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
            ring[size - 1].copy_(t)
        self._run_states = ReservedStates(rings, tokens)
        return self._run_states

    def decode_block(self) -> StateWrite | None:
        """Stage the open block of n tokens as the run that `reserve_slots` reserved wrote it: the states after its
        n-th step, and the trail of the m = trail_length(n) steps before. None, changing nothing, where there is no
        such run (or it reserved fewer steps)."""
        block, run = self.seq.block, self.__dict__.get("_run_states")
        if block is None or run is None or self._staged is not None or not 0 < block.tokens <= run.tokens:
            return None
        n, m = block.tokens, self.trail_length(block.tokens)
        if next(iter(run.rings.values())).shape[1] != self.batch_size:
            return None
        self._run_states = None
        trail = None
        if m > 0:  # the states after steps n - m - 1 .. n - 2, [B, m, ...] each
            steps = [run.write(j) for j in range(n - m - 1, n - 1)]
            trail = {name: torch.stack([s[name] for s in steps], dim=1) for name in run.rings}
        self._staged = StateWrite(run.write(n - 1), trail)
        return self._staged

    def end_reservation(self) -> None:
        """Let go of the state buffers `reserve_slots` gave a run (Cache.feed_reserved calls it, fed or not)."""
        self._run_states = None

    def _check_states(self, new_states: dict[str, Any], extra: int | None = None) -> None:
        expected = self.spec.state_shapes()
        what = "state" if extra is None else "trail state"
        if set(new_states) != set(expected):
            raise CacheError(
                f"{self.name}: update needs exactly the states {sorted(expected)}, got {sorted(new_states)}"
            )
        for name, (shape, dtype) in expected.items():
            t = new_states[name]
            want = (self.batch_size, *shape) if extra is None else (self.batch_size, extra, *shape)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CacheError(f"{self.name}: {what} '{name}' must have shape {want}, got {got}")
            if t.dtype != dtype:
                raise CacheError(f"{self.name}: {what} '{name}' must have dtype {dtype}, got {t.dtype}")
            if t.device != self.device:
                raise CacheError(f"{self.name}: {what} '{name}' is on {t.device}, the layer is on {self.device}")

    def update(
        self,
        valid: torch.Tensor | int | None = None,
        trail: dict[str, torch.Tensor] | None = None,
        **new_states: torch.Tensor,
    ) -> None:
        """Replace every state after a block. Inside a Cache the block was opened by the Cache; a standalone layer
        takes the block's real-token mask [B, T] or its length T as `valid`. With rollback on, `trail` holds the
        states after each of the block's last `trail_length(T)` tokens before the final one ([B, m, ...] each);
        without it those columns are simply not available to `crop`."""
        self._check_states(new_states)
        if self.seq.block is not None:
            tokens = self.seq.block.tokens
        elif isinstance(valid, int) and not isinstance(valid, bool):
            tokens, valid = valid, None
        elif isinstance(valid, torch.Tensor) and valid.dim() == 2:
            tokens = valid.shape[1]
        else:
            raise CacheError(f"{self.name}: valid must be a real-token mask [B, T] or a token count, got {valid!r}")
        m = self.trail_length(tokens)
        if trail is not None and m > 0:
            self._check_states(trail, extra=m)
        _, opened = self._open(valid, tokens)
        self._staged = StateWrite(new_states, trail if m > 0 else None)
        self._close(opened, failed=False)

    def _commit_staged(self, staged: StateWrite) -> None:
        new_states, trail = staged.states, staged.trail
        k, layout = self.spec.rollback, self.layout
        old, end = self.seq.columns, self.seq.columns + self.seq.block.tokens
        if k or layout.feedback:
            self._fetch()
        held = self._held() if layout.feedback else None  # the residuals to feed back
        stream = getattr(self, "cache_index", 0)  # keys stochastic rounding's uniforms per layer (Cache sets it)
        new = layout.encode(new_states, held, end if layout.stochastic else None, stream)
        if k:  # keep the states after the last k columns: older trail entries, the state before the block, the trail
            m = 0 if trail is None else next(iter(trail.values())).shape[1]
            # [B, m, ...] each, encoded as a block ending there would have been (the same residual fed back, the
            # uniforms of its column), so crop(c) then continuing equals feeding the block split at c
            trail_keys = list(range(end - m, end)) if layout.stochastic else None
            trail_parts = layout.encode(trail, held, trail_keys, stream) if m else {}
            columns = self.trail_columns.tolist() + [old] + list(range(end - m, end))
            keep = [i for i, c in enumerate(columns) if c >= 0 and c >= end - k][-k:]
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.trail_columns.fill_(-1)
            self.trail_columns[k - len(keep) :] = torch.tensor([columns[i] for i in keep], dtype=torch.long)
            for attr, current in self._held().items():
                parts = [getattr(self, f"{attr}_trail"), current[:, None]] + ([trail_parts[attr]] if m else [])
                picked = torch.cat(parts, dim=1).index_select(1, index)
                getattr(self, f"{attr}_trail")[:, k - len(keep) :] = picked
        for attr, t in new.items():
            if self._tier is None:
                getattr(self, attr).copy_(t)
            else:  # parking copies it onto the parked part in place
                setattr(self, attr, t)
        self._park()

    def _prepare_crop(self, n: int, seen: torch.Tensor) -> int | None:
        if n == self.columns:
            return None
        k = self.spec.rollback
        held = self.trail_columns.tolist() if k else []
        if n in held:
            return held.index(n)
        hint = (
            f"it keeps states for columns {sorted(c for c in held if c >= 0)} only (rollback={k})"
            if k
            else "it keeps only its latest state"
        )
        raise CacheCropError(
            f"{self.name}: {hint}, so crop({n}) cannot rewind it from {self.columns} tokens. Set `rollback: k` "
            "on recurrent layers (cache config {'recurrent': {'rollback': k}}) to crop back up to k tokens, or "
            "take snap = cache.snapshot() at the point you may return to and cache.restore(snap)."
        )

    def _commit_crop(self, plan: int | None) -> None:
        if plan is None:
            return
        n = int(self.trail_columns[plan])
        self._fetch()
        for attr, held in self._held().items():  # the encoded checkpoint, bit for bit
            held.copy_(getattr(self, f"{attr}_trail")[:, plan])
        self.trail_columns.masked_fill_(self.trail_columns >= n, -1)  # trail entries past the new end are gone
        self._park()

    def _commit_index(self, index: torch.Tensor) -> None:
        self._fetch()
        super()._commit_index(index)
        self._park()

    def _commit_restore(self, snap: Any) -> None:
        super()._commit_restore(snap)  # writes into the parked parts (or replaces them: then parking moves them)
        self._park()


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

"""`BridgeCache`: a `transformers.Cache` whose layers are our cache layers, for HF's own modeling code.

It holds one of our `Cache`s (`.hybrid`, built from the resolved plan when the first block's batch size is known,
or at once when `batch_size` is given) and one HF-facing adapter per HF decoder layer (attention_layer.py,
state_layer.py, hybrid_layer.py; HF's `DummyLayer` for layers that cache nothing).

A forward of the model is one block of our cache: the bridge's forward hooks (installer.py) open it before the model
runs (the block's real-token mask is the last T columns of HF's 2-D attention mask; positions exclude left padding
as HF's generate computes them) and commit it after (every layer fed, or nothing changes: a forward that raises
leaves the cache as it was). HF's whole-cache operations map onto ours: `crop(-n)` drops the last n columns
(recurrent layers through their trails), `reorder_cache` is `reorder` (beam search), `batch_repeat_interleave`
is `repeat`, `batch_select_indices` is `select`, `reset` is `reset`; each is one transaction over every layer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import DummyLayer, DynamicLayer

from hybridcache.cache import Cache, CacheGroup, CachePlan, NativeGroup, get_layer_class
from hybridcache.hf.errors import BridgeConfigError, BridgeError
from hybridcache.hf.layers.attention import BridgeAttentionLayer
from hybridcache.hf.layers.compressed import BridgeCompressedLayer
from hybridcache.hf.layers.hybrid import BridgeHybridLayer
from hybridcache.hf.layers.indexed import BridgeIndexedLayer
from hybridcache.hf.layers.multi_state import BridgeMultiStateLayer
from hybridcache.hf.layers.state import BridgeStateLayer
from hybridcache.hf.layout import ModelLayout
from hybridcache.hf.native import BridgePlan
from hybridcache.hf.own_cache import BridgeLinearStateLayer
from hybridcache.hf.queries import query_inputs


class BridgeCache(HFCache):
    """A `transformers.Cache` backed by a hybridcache `Cache` (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        layout: ModelLayout,
        bridge: BridgePlan,
        plan: CachePlan,
        batch_size: int | None = None,
        hf_masks: bool = False,
    ) -> None:
        check_hf_maskable(layout, bridge, plan, only=None if hf_masks else _indexed_entries(layout, bridge))
        self.hf_masks = hf_masks
        self._model = weakref.ref(model)
        self.layout, self.bridge, self.plan = layout, bridge, plan
        self.hybrid: Cache | None = None
        self.block_open = False  # a forward is running (begin .. end)
        self._block_ready = False  # its block is open in our cache (open_block)
        self._pending: tuple = ()
        self._depth = 0  # nested hooked modules of one forward (the CausalLM and its decoder)
        self._hf_maskable: set[int] = set()
        self._by_address: dict[tuple[int, str | None], Any] = {}
        self._views: dict[int, tuple[torch.Tensor, Any, Any, list[bool]]] = {}  # id(keys) -> (keys, view, layer, seen)
        self._last: tuple[torch.Tensor, Any, Any, list[bool]] | None = None  # the block's latest update
        # pre-rotary queries of this block's attention modules, kept (queries.py) only where a layer models them
        self.keeps_queries = any(getattr(get_layer_class(p.type), "needs_queries", False) for p in plan.layers)
        self.captured_queries: dict[int, torch.Tensor] = {}
        self._device = _one_device(layout)
        layers: list[Any] = []
        for info in layout.layers:
            if info.dummy:
                layers.append(DummyLayer())
            elif not info.cached:
                layers.append(UnusedLayer(info.index))
            elif info.index in bridge.parts:
                layers.append(BridgeMultiStateLayer(self, info.index, info.attention, bridge.parts[info.index]))
            elif info.compressors:
                layers.append(BridgeCompressedLayer(self, info.index, info.attention, info.compressors))
            elif info.indexer_dim is not None:
                layers.append(BridgeIndexedLayer(self, info.index, info.attention, info.indexer_dim))
            elif info.attention is not None and info.states is not None:
                layers.append(
                    BridgeHybridLayer(self, info.index, info.attention, info.states, bridge.state_type[info.index])
                )
            elif info.attention is not None:
                native_type = self._native(info.index).type
                layers.append(BridgeAttentionLayer(self, info.index, info.attention, native_type))
            elif not info.states.conv:
                layers.append(BridgeLinearStateLayer(self, info.index, info.states))
            else:
                layers.append(BridgeStateLayer(self, info.index, info.states))
        HFCache.__init__(self, layers=layers)  # not super(): a family's subclass may add its own cache class
        if batch_size is not None:
            self._build(batch_size)

    def __repr__(self) -> str:
        return f"BridgeCache({self.layout.model_type}; {self.hybrid!r})"

    # -- our cache -------------------------------------------------------------------------------------------------
    def _native(self, index: int):
        return self.bridge.native[self.bridge.entry_of[index]]

    def _build(self, batch_size: int) -> None:
        self.hybrid = Cache.from_plan(self.plan, batch_size, self._device)
        self._by_address: dict[tuple[int, str | None], Any] = {}  # (HF layer, member) -> our layer (entries are fixed)
        # our layers whose slots HF's own masks describe (a model may attend to them without the bridge's mask)
        self._hf_maskable = {
            id(layer)
            for layer, p in zip(self.hybrid.layers, self.plan.layers)
            if hf_maskable(p, native_params(self.bridge, p))
        }

    def cache_layer(self, index: int, member: str | None):
        """Our cache layer serving HF decoder layer `index` (group member `member`); needs the cache built."""
        layer = self._by_address.get((index, member))
        if layer is None:
            if self.hybrid is None:
                raise BridgeError("the cache holds no layers yet: its first forward builds them for that batch size")
            entry = self.hybrid[self.bridge.entry_of[index]]
            layer = self._by_address[index, member] = entry[member] if isinstance(entry, CacheGroup) else entry
        return layer

    def _plan_of(self, index: int, member: str | None):
        entry = self.bridge.entry_of[index]
        for p in self.plan.layers:
            if p.index == entry and (member is None or p.member == member):
                return p
        raise BridgeError(f"decoder layer {index} has no cache member {member!r}")

    def plan_spec(self, index: int, member: str | None):
        return self._plan_of(index, member).spec

    def layer_type(self, index: int, member: str | None) -> str:
        return self._plan_of(index, member).type

    @property
    def columns(self) -> int:
        return 0 if self.hybrid is None else self.hybrid.columns

    # -- blocks (opened and closed by the forward hooks, installer.py) -----------------------------------------------
    def begin(self, tokens: int, valid: torch.Tensor | None, ids: torch.Tensor | None, batch: int) -> None:
        """A forward starts: its block opens when a layer first uses the cache (`open_block`)."""
        if self.block_open:
            raise BridgeError("a forward of this cache is already running (one forward at a time)")
        self._pending = (tokens, valid, ids, batch)
        self.block_open = True

    def open_block(self, tokens: int | None = None, device: torch.device | None = None) -> None:
        """Open this forward's block in our cache (once), for `tokens` columns: what the layers receive, which is
        the input's length except in models that add tokens of their own (CPM-Ant's prompt) or feed fewer.
        `device`: where the calling layer's keys arrive; the first forward builds our cache there (lazy
        initialization: a model moved after its probe is followed), and keys on another device are refused."""
        if not self.block_open:
            raise BridgeError(
                "the cache is used outside a forward the bridge saw: run the model (or its decoder) that cache_for was "
                "given, with this cache as its `cache` argument"
            )
        if self._block_ready:
            self.check_device(device)
            return
        n, valid, ids, batch = self._pending
        if self.hybrid is None:
            if device is not None:
                self._device = device
            self._build(batch)
        self.check_device(device)
        if valid is not None:
            valid = valid.to(self.hybrid.device)
            if bool(valid.all()):
                valid = None  # every token real: our layers skip the masking work
        if tokens is not None and tokens != n:
            # CPM-Ant: its own prompt tokens go before the input, ahead of a row's left padding, which our cache
            # cannot hold (padding only comes first); every layer of such a family attends with HF's mask (hf_masks:
            # it hides the padding), so the block is fed as all real (seen then counts that padding). Its later
            # forwards take the whole sequence and feed the cache only its last tokens.
            if valid is not None and tokens > n:
                if not self.hf_masks:
                    raise BridgeError(
                        f"{self.layout.model_type}: the model fed {tokens} tokens to its cache for {n} input tokens, "
                        "so the attention mask's padding cannot be placed"
                    )
                valid = None
            elif valid is not None:
                valid = valid[:, -tokens:]
                if bool(valid.all()):
                    valid = None
            ids, n = None, tokens
        self.hybrid.begin_block(valid, n, ids=None if ids is None else ids.to(self.hybrid.device))
        self._block_ready = True

    def layer_device(self, index: int) -> torch.device | None:
        """Where HF decoder layer `index`'s weights live (its states are made there), None if the decoder keeps no
        `layers` list: what a recurrent layer, which hands no keys, builds our cache by."""
        model = self._model()
        decoder = model.get_decoder() if model is not None and callable(getattr(model, "get_decoder", None)) else None
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or index >= len(layers):
            return None
        weight = next(layers[index].parameters(), None)
        return None if weight is None else weight.device

    def check_device(self, device: torch.device | None) -> None:
        """Keys arriving on another device than our cache's (a model split over devices, or moved after its cache
        was built) are a named error before anything is stored."""
        if device is not None and self.hybrid is not None and torch.device(device) != self.hybrid.device:
            raise BridgeError(
                f"{self.layout.model_type}: keys arrive on {device}, and this cache lives on {self.hybrid.device}; a "
                "hybridcache Cache keeps one device, so the bridge needs the model's cached layers on one device "
                "(and a new cache_for after moving the model)"
            )

    def end(self, failed: bool) -> None:
        if not self.block_open:
            return
        if not self._block_ready:  # the forward never used its cache
            self.block_open = False
            return
        try:
            if failed:
                self.hybrid.abort_block()
                return
            try:
                for layer in self.layers:
                    if isinstance(layer, (BridgeStateLayer, BridgeMultiStateLayer)):
                        layer.flush()
                unread = [
                    layer
                    for _, _, layer, seen in self._views.values()
                    if not seen[0] and id(layer) not in self._hf_maskable
                ]
                if unread:
                    raise BridgeError(
                        f"{self.layout.model_type}: {len(unread)} attention layer(s) ({unread[0].type_name}, ...) "
                        "were attended to without the bridge's mask (the model computed attention outside "
                        "transformers' AttentionInterface, or on keys it rebuilt), and HF's own mask does not "
                        "describe their layout; keep those layers native with dynamic storage"
                    )
                self.hybrid.end_block()
            except BaseException:
                self.hybrid.abort_block()
                raise
        finally:
            self.block_open = self._block_ready = False
            self._views.clear()
            self.captured_queries.clear()
            self._last = None
            for layer in self.layers:
                if isinstance(layer, (BridgeStateLayer, BridgeAttentionLayer)):
                    layer.end_block()

    # -- views for the attention function (attention_fn.py) -------------------------------------------------------
    def attends_with_hf_mask(self, layer: Any) -> bool:
        """Whether our `layer` attends with HF's own mask (its layout is HF's: `hf_maskable`)."""
        return id(layer) in self._hf_maskable

    def record_view(self, keys: torch.Tensor, view: Any, layer: Any) -> None:
        self._views[id(keys)] = self._last = (keys, view, layer, [False])

    def view_for(self, keys: torch.Tensor) -> tuple[Any, Any, bool] | None:
        """(view, our layer, first use) for the keys an attention call receives: the very tensor an `update` of this
        block returned, or else keys the module derived from the latest update's (multi-head latent attention
        expands its cached latents; JetMoE repeats heads), recognised by their slot count."""
        found = self._views.get(id(keys))
        if found is None or found[0] is not keys:
            last = self._last
            if last is None or last[3][0] or last[1].keys.shape[-2] != keys.shape[-2]:
                return None
            if last[1].key_positions.dim() == 3:
                raise BridgeError(
                    f"{self.layout.model_type}: its attention transforms the cached keys before attending, so a "
                    f"pattern that keeps different tokens per kv head ({last[2].type_name}) cannot be mapped onto them"
                )
            found = last
        _, view, layer, seen = found
        first, seen[0] = not seen[0], True
        return view, layer, first

    def query_inputs(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None):
        """The pre-rotary queries of HF attention `module`'s call (queries.py), for a press that models them."""
        return query_inputs(self, module, query, scaling)

    # -- HF's Cache API ---------------------------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        """Columns of the block being fed (0 outside a forward)."""
        return self.hybrid.current_block.tokens if self._block_ready else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.get_seq_length() if isinstance(layer, BridgeAttentionLayer) else self.columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """HF sizes one mask per layer type from the first layer of that type (`layer_idx`). The bridge answers for
        the first layer of that native type that HF's masks describe (`hf_maskable`: those layers attend with HF's
        mask), so a re-typed first layer does not size the mask of native ones."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(layer, BridgeAttentionLayer):
            return super().get_mask_sizes(query_length, layer_idx)
        native = self.bridge_native_type(layer_idx)
        for other in self.layers:
            if (
                isinstance(other, BridgeAttentionLayer)
                and self.bridge_native_type(other.index) == native
                and self.maskable(other.index, other.attention_member)
            ):
                return other.get_mask_sizes(query_length)
        return layer.get_mask_sizes(query_length)

    def bridge_native_type(self, index: int) -> str:
        p = self._plan_of(index, "attention" if isinstance(self._native(index), NativeGroup) else None)
        return p.native_type

    def maskable(self, index: int, member: str | None) -> bool:
        """Whether HF's own mask for this layer's native type describes its slots (see `hf_maskable`)."""
        p = self._plan_of(index, member)
        return hf_maskable(p, native_params(self.bridge, p))

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return -1 if self.hybrid is None else self.hybrid.batch_size

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False

    def _operation(self, what: str) -> None:
        if self.block_open:
            raise BridgeError(f"BridgeCache.{what}: a forward is running")

    def reset(self) -> None:
        self._operation("reset")
        if self.hybrid is not None:
            self.hybrid.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """HF's convention: crop(-n) removes the last n columns; crop(0) changes nothing."""
        self._operation("crop")
        if tokens_to_remove > 0:
            raise BridgeError(
                f"crop({tokens_to_remove}): HF's caches take a negative count of columns to remove; to keep the "
                "first n columns call cache.hybrid.crop(n)"
            )
        if tokens_to_remove and self.hybrid is not None:
            self.hybrid.crop(self.hybrid.columns + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._operation("reorder_cache")
        if self.hybrid is not None:
            self.hybrid.reorder(beam_idx.to(self.hybrid.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._operation("batch_repeat_interleave")
        if self.hybrid is not None:
            self.hybrid.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._operation("batch_select_indices")
        if self.hybrid is not None:
            self.hybrid.select(indices.to(self.hybrid.device))

    def activate_past_recording(self) -> None:
        raise BridgeError(
            "HF's past recording (assisted decoding) is not supported by the bridge; roll back with cache.crop and "
            "our recurrent rollback ({'recurrent': {'rollback': k}})"
        )

    def model_is(self, model: Any) -> bool:
        return self._model() is model


class UnusedLayer(DynamicLayer):
    """An HF cache layer the probe saw the model leave empty (Mllama's cross-attention without an image): HF reads it
    as uninitialized; an update is refused (the bridge serves the layers the model caches in a text forward)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def update(self, key_states, value_states, *args, **kwargs):
        raise BridgeError(
            f"decoder layer {self.index} kept no cache in the bridge's probe (a text-only forward), so the bridge does "
            "not serve it (cross-attention to images is not bridged)"
        )


# Storage formats whose slots stay one per column, in column order (HF's masks describe them)
COLUMN_STORAGES = ("dense", "int8", "int4", "offload")


def native_params(bridge: BridgePlan, p) -> dict[str, Any]:
    """The native parameters (shapes, window, chunk size) of plan layer `p`."""
    entry = bridge.native[p.index]
    return dict((entry.members[p.member] if p.member is not None else entry).params)


def hf_maskable(p, native: dict[str, Any]) -> bool:
    """Whether HF's own mask for this layer's native type describes its slots: its native pattern (type, window,
    chunk size) with dynamic storage whose slots are the last columns in order (`get_mask_sizes` gives their count
    and first column)."""
    spec = p.spec
    return (
        p.kind == "attention"
        and p.type == p.native_type
        and p.type in ("full", "sliding")  # (HF's chunked layers keep a sliding window, ours the current chunk)
        and all(getattr(spec, k, None) == native[k] for k in ("window", "chunk_size") if k in native)
        and getattr(spec, "max_length", None) is None
        and getattr(spec, "storage", "dense") in COLUMN_STORAGES
    )


def _indexed_entries(layout: ModelLayout, bridge: BridgePlan) -> set[int]:
    """Our cache entries serving DSA layers (their index selection reaches attention inside HF's mask) and
    DeepSeek-V4's compressed ones (their entries join attention inside HF's mask)."""
    return {bridge.entry_of[info.index] for info in layout.layers if info.indexer_dim is not None or info.compressors}


def check_hf_maskable(layout: ModelLayout, bridge: BridgePlan, plan: CachePlan, only: set[int] | None = None) -> None:
    """Layers that attend with HF's masks (every attention layer of a family that masks its attention itself, no
    AttentionInterface; or, `only`, the entries of DSA layers) must be `hf_maskable`. Anything else is refused here,
    before any work."""
    for p in plan.layers:
        if p.kind != "attention" or (only is not None and p.index not in only):
            continue
        spec = p.spec
        if not hf_maskable(p, native_params(bridge, p)):
            why = (
                "its sparse attention (DSA) or compressed attention (DeepSeek-V4) selects or adds keys inside HF's mask"
                if only is not None
                else "it computes attention in its own code (it predates transformers' AttentionInterface)"
            )
            raise BridgeConfigError(
                f"{layout.model_type}: {why}, and HF's masks only describe native patterns; cache layer "
                f"{p.address} ({p.type}, {spec.params()}) cannot be served: keep the native type with dynamic storage "
                f"({', '.join(COLUMN_STORAGES)})"
            )


def _one_device(layout: ModelLayout) -> torch.device:
    devices = {info.attention.device for info in layout.layers if info.attention is not None}
    devices |= {info.states.device for info in layout.layers if info.states is not None}
    if len(devices) > 1:
        raise BridgeError(
            f"{layout.model_type}: its cache layers live on several devices ({', '.join(sorted(map(str, devices)))}); "
            "a hybridcache Cache keeps one device for now, so the bridge needs a model on one device"
        )
    return devices.pop() if devices else layout.input_device

"""The conformance kit: `check_cache_type("name")` checks a registered cache type against the cache-layer contract.

It is what the test suite runs over every registered type (and every attention type with every storage format),
so a new type gets its tests for free:

    from hybridcache.testing import check_cache_type
    check_cache_type("sink")                       # example parameters from the class
    check_cache_type("sliding", params={"window": 3, "storage": "int8"})

Checks (each on dynamic and preallocated storage, on left-padded batches, with seeded random data):
- split == one-shot: attention outputs for every split equal a naive whole-sequence attention with the spec's own
  pattern (`visible`), to 1e-9 in float64; lossy types stay within their documented bound instead;
- held <= needed: dynamic storage holds what the next query can see (`min_nbytes`), preallocated storage what the
  spec says it allocates (`held_nbytes`);
- crop: either exact (continuing after crop(n) equals continuing after the first n columns) or a CacheCropError that
  changes nothing;
- snapshot / restore: bit-exact, and the same continuation gives the same result again;
- reorder / select / repeat: rows move with their history;
- atomic failures: bad calls raise CacheError and leave the whole cache unchanged;
- memory accounting: `Cache.nbytes()` agrees with the plan's `held_nbytes` for preallocated storage.
Recurrent types get the checks that apply to states (shapes and dtypes from the spec, staging, batch operations,
snapshot, crop refusal or exactness, atomic failures, accounting); a lossy `state_codec` must give back exactly its
own round trip of what it was handed (`layer.round_trip`), rollback and batch operations included. Compressed
types (`compressed_kv`) get compressed_kit.py's checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.cache import get_layer_class
from hybridcache.cache.compressed import CompressedKVLayer
from hybridcache.cache.storage.codecs import available_codecs, codec_class
from hybridcache.testing.attention_kit import _AttentionKit
from hybridcache.testing.compressed_kit import _CompressedKit
from hybridcache.testing.kit import ATTENTION_SHAPES, EXACT_TOL, ConformanceError  # noqa: F401
from hybridcache.testing.recurrent_kit import _RecurrentKit


def check_cache_type(
    name: str,
    params: Mapping[str, Any] | None = None,
    native: Mapping[str, Any] | None = None,
    seed: int = 0,
    cases: int = 6,
) -> dict[str, int]:
    """Run the contract checks on cache type `name`; raises ConformanceError naming the first broken property.

    `params`: the type's tunable parameters (default: the class's `example_params`); `native`: the model-side
    parameters (shapes; default: `example_native`, or attention shapes for attention types). Returns how many
    cases each check ran.
    """
    cls = get_layer_class(name)
    params = {**getattr(cls, "example_params", {}), **dict(params or {})}
    storage = params.get("storage")
    if cls.kind == "attention" and isinstance(storage, str) and storage in available_codecs():
        params = {**getattr(codec_class(storage), "kit_params", {}), **params}  # options fitting head_dim 8
    native = dict(
        native or getattr(cls, "example_native", None) or (ATTENTION_SHAPES if cls.kind == "attention" else {})
    )
    if cls.kind == "attention":
        return _AttentionKit(name, cls, native, params, seed).run(cases)
    if issubclass(cls, CompressedKVLayer):
        return _CompressedKit(name, cls, native, params, seed).run(cases)
    return _RecurrentKit(name, cls, native, params, seed).run(cases)

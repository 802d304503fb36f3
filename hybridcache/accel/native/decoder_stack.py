"""Many decoder layers of one decode step in one C call (kernels/cpu_decode.c, hc_decoder_stack).

Each layer's call is a record of hc_decoder_layer's arguments (cpu_decoder_layer.py, `run.record`: the same checks,
the same kernels in the same order, so the same numbers); the C side runs the records in order. What goes is the
interpreter between layers, which ran with the caches cold after each layer's weights: on a 2-core Xeon, Gemma 3
270M with int8 weights, the layers' Python went from 4.4 to 1.9 ms a step and the step from 16.8 to ~13.7 ms.

The record's layout is the library's: it states its fields' names (`hc_layer_record_names`: the ctypes fields'), types
(`hc_layer_record_codes`) and size, and the types must be op_declarations.LAYER_RECORD (hc_decoder_layer's declared
signature) and the size ctypes' layout of it, or nothing here runs.
"""

from __future__ import annotations

import ctypes

from hybridcache.accel.native.library import _library
from hybridcache.accel.native.op_declarations import _F, _I, _L, _P, LAYER_RECORD

_CODES = {_P: "P", _I: "I", _L: "L", _F: "F"}
_state: dict = {}  # lib -> the record type checked against it (None: it does not match)


def record_type() -> type[ctypes.Structure] | None:
    """The ctypes Structure of one layer's record, or None (no library, or its record is not the declared one)."""
    lib = _library()
    if lib is None:
        return None
    key = id(lib)
    if _state.get("lib") != key:
        names = lib.hc_layer_record_names().decode().split(",")
        record = None
        if len(names) == len(LAYER_RECORD) and len(set(names)) == len(names) and all(n.isidentifier() for n in names):
            fields = list(zip(names, LAYER_RECORD, strict=True))
            record = type("LayerRecord", (ctypes.Structure,), {"_fields_": fields})
            declared = "".join(_CODES[t] for t in LAYER_RECORD)
            if lib.hc_layer_record_codes() != declared.encode() or lib.hc_layer_record_size() != ctypes.sizeof(record):
                record = None
        _state.update(lib=key, record=record)
    return _state["record"]


def call_records(records: list[tuple]) -> None:
    """Run hc_decoder_layer on each argument tuple (cpu_decoder_layer.py `run.record`, whose checks they passed), in
    order, by one call. Raises MemoryError naming the layer whose attention found no memory for its scratch (the
    layers before it ran)."""
    call_table(record_table(records))


def record_table(records: list[tuple]) -> ctypes.Array:
    """The records as the C array hc_decoder_stack reads (fields by name: a caller may change some between calls,
    as accel/runs/decode_run.py does, pointing only into tensors it keeps alive and checked as `run.record` checks)."""
    record = record_type()
    if record is None:
        raise RuntimeError("hc_decoder_stack: the library's layer record is not the declared one")
    return (record * len(records))(*(record(*r) for r in records))


def call_table(table: ctypes.Array) -> None:
    """hc_decoder_stack over a `record_table`."""
    failed = ctypes.c_int(-1)
    if _library().hc_decoder_stack(ctypes.addressof(table), len(table), ctypes.addressof(failed)):
        raise MemoryError(f"hc_decoder_stack: layer {failed.value} found no memory for its attention's scratch")

"""Saved cache files treated as untrusted (issue 22, "Files"): exclusive temp files, forged headers and payloads,
keyed signatures, the model identity over every byte.

Forged files are written the way an attacker would: tensors and header edited, then the unkeyed hashes recomputed
here from the documented algorithm (hashlib over canonical JSON / tensor bytes), not with our own helpers."""

import math
import os
import resource
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hybridcache as hc
from hybridcache.cache import Cache, CacheError
from hybridcache.cache.io.persistence import CacheFileError, save_cache
from tests.models.conftest import prompts
from tests.models.saved_cache import forge, read, save_jamba_cache  # noqa: F401  (forge, read: tests/hostile)


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    return save_jamba_cache(models, tmp_path_factory.mktemp("saved"))


def state(cache):
    snap = cache.snapshot()
    return [snap.seen, *[t for layer in snap.layers for _, t in sorted(layer.tensors.items())]]


# -- 1. the temporary file ----------------------------------------------------------------------------------------
def test_save_never_follows_a_symlink_planted_at_a_temp_name(saved, tmp_path):
    model, cache, _ = saved
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    target = tmp_path / "c.safetensors"
    for name in ("c.safetensors.tmp", ".c.safetensors.tmp", "c.tmp", "c.safetensors~"):  # fixed names a saver
        os.symlink(victim, tmp_path / name)  # might pick, all pointing at the victim
    cache.save(target, model=model)
    assert victim.read_bytes() == b"precious"
    assert all((tmp_path / n).is_symlink() for n in ("c.safetensors.tmp", ".c.safetensors.tmp", "c.tmp"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == ["c.safetensors", "victim.txt"]
    assert all(torch.equal(a, b) for a, b in zip(state(cache), state(Cache.load(target, model))))
    os.symlink(victim, tmp_path / "link.safetensors")  # the target itself a link: the link is replaced, not followed
    cache.save(tmp_path / "link.safetensors", model=model)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "link.safetensors").is_symlink()


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_save_leaves_no_temp_file_and_the_target_unchanged(saved, tmp_path, monkeypatch, failure):
    model, cache, _ = saved
    target = tmp_path / "c.safetensors"
    target.write_bytes(b"the previous cache")

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(type(failure)):
        cache.save(target, model=model)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    assert target.read_bytes() == b"the previous cache"


# -- 3. header sizes and malformed fields -------------------------------------------------------------------------
class _NoBigAllocations(TorchFunctionMode):
    """Fails a torch factory call asking for more than `limit` elements (before it allocates anything; the meta
    device allocates nothing, so it is allowed anything)."""

    FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_strided}

    def __init__(self, limit=1 << 24):
        super().__init__()
        self.limit = limit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and str(kwargs.get("device")) != "meta":
            first = args[0] if args else kwargs.get("size", ())
            size = first if isinstance(first, (tuple, list, torch.Size)) else [a for a in args if type(a) is int]
            n = math.prod(int(d) for d in size)
            assert n <= self.limit, f"torch.{func.__name__} of {n} elements"
        return func(*args, **kwargs)


def test_a_header_claiming_a_huge_batch_and_columns_fails_fast_without_allocating(saved, tmp_path):
    model, _, path = saved
    header, tensors = read(path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for batch, columns in ((10**9, 10**10), (2, 10**10), (10**9, header["columns"]), (1000, header["columns"])):
        bad = forge(path, tmp_path / "bad", {**header, "batch_size": batch, "columns": columns}, tensors)
        start = time.perf_counter()
        with _NoBigAllocations(), pytest.raises(CacheFileError, match="batch_size|columns"):
            Cache.load(bad, model)
        assert time.perf_counter() - start < 5
    # a layer spec claiming preallocated storage of 10^9 tokens per row, the tensors unchanged
    layers = [dict(r) for r in header["layers"]]
    layers[2] = {**layers[2], "spec": {**layers[2]["spec"], "max_length": 10**9}}
    bad = forge(path, tmp_path / "bad", {**header, "layers": layers}, tensors)
    with _NoBigAllocations(), pytest.raises(CacheFileError, match="layer 2"):
        Cache.load(bad, model)
    layers[2] = header["layers"][2]
    layers[0] = {**layers[0], "spec": {**layers[0]["spec"], "state_size": 10**7}}  # a recurrent state of 10^7 columns
    bad = forge(path, tmp_path / "bad", {**header, "layers": layers}, tensors)
    with _NoBigAllocations(), pytest.raises(CacheFileError, match=r"layers?\W*0"):
        Cache.load(bad, model)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # KiB: no big allocation either


def _set(path, value):
    """A change to the header at a dotted path ("layers.2.spec.num_kv_heads"); value DELETE removes the field."""

    def change(header):
        *parents, last = path.split(".")
        node = header
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            last = int(last)
        if value is DELETE:
            del node[last]
        else:
            node[last] = value

    return change


DELETE = object()
FORGED_HEADERS = [  # (change, the field the error must name)
    (_set("batch_size", DELETE), "batch_size"),
    (_set("batch_size", "2"), "batch_size"),
    (_set("batch_size", True), "batch_size"),
    (_set("batch_size", 2.0), "batch_size"),
    (_set("batch_size", 0), "batch_size"),
    (_set("batch_size", -1), "batch_size"),
    (_set("batch_size", 3), "batch_size"),
    (_set("columns", DELETE), "columns"),
    (_set("columns", "12"), "columns"),
    (_set("columns", -1), "columns"),
    (_set("columns", 1e10), "columns"),
    (_set("columns", 2), "columns"),
    (_set("columns", None), "columns"),
    (_set("has_fingerprint", DELETE), "has_fingerprint"),
    (_set("has_fingerprint", "yes"), "has_fingerprint"),
    (_set("has_fingerprint", 1), "has_fingerprint"),
    (_set("has_fingerprint", False), "has_fingerprint"),
    (_set("model", DELETE), "model"),
    (_set("model", "jamba"), "model"),
    (_set("model.family", DELETE), "model.family"),
    (_set("model.weights_sha256", 7), "model.weights_sha256"),
    (_set("layers", DELETE), "layers"),
    (_set("layers", {}), "layers"),
    (_set("layers", []), "layers"),
    (_set("layers.0", "mamba"), r"layers\[0\]"),
    (_set("layers.0.index", DELETE), r"layers\[0\]\.index"),
    (_set("layers.1.index", "1"), r"layers\[1\]\.index"),
    (_set("layers.1.index", 5), r"layers\[1\]\.index"),
    (_set("layers.1.index", 0), r"layers\[1\]\.index"),
    (_set("layers.0.member", 3), r"layers\[0\]\.member"),
    (_set("layers.2.type", DELETE), r"layers\[2\]\.type"),
    (_set("layers.2.type", "nope"), r"layers\[2\]\.(spec|type)"),
    (_set("layers.2.type", "sliding"), r"layers\[2\]\.(spec|type)"),
    (_set("layers.2.spec", DELETE), r"layers\[2\]\.spec"),
    (_set("layers.2.spec", [1]), r"layers\[2\]\.spec"),
    (_set("layers.2.spec.num_kv_heads", "2"), r"layers\[2\]\.spec"),
    (_set("layers.2.spec.num_kv_heads", DELETE), r"layers\[2\]\.spec"),
    (_set("layers.2.spec.bogus", 1), r"layers\[2\]\.spec"),
    (_set("layers.2.spec.dtype", {"dtype": "float33"}), r"layers\[2\]\.spec\.dtype"),
    (_set("layers.2.spec.dtype", {"tuple": 5}), r"layers\[2\]\.spec\.dtype"),
    (_set("layers.2.spec.dtype", [1, 2]), r"layers\[2\]\.spec\.dtype"),
    (_set("layers.2.spec.num_kv_heads", 4), "layer 2"),
    (_set("layers.0.spec.state_size", 9), "layer 0"),
    (_set("layers.2.tensors", DELETE), r"layers\[2\]\.tensors"),
    (_set("layers.2.tensors", "key_pos"), r"layers\[2\]\.tensors"),
    (_set("layers.2.tensors", ["key_pos", "key_pos"]), r"layers\[2\]\.tensors"),
    (_set("layers.2.tensors", ["key_pos", "keys_data"]), "layer"),
    (_set("layers.2.tensors.0", "nope"), "layer"),
]


@pytest.mark.parametrize("change, field", FORGED_HEADERS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(FORGED_HEADERS)])
def test_every_malformed_header_is_a_cache_file_error_naming_the_field(saved, tmp_path, change, field):
    model, _, path = saved
    header, tensors = read(path)
    change(header)
    bad = forge(path, tmp_path / "bad", header, tensors)
    with _NoBigAllocations(), pytest.raises(CacheFileError, match=field):
        Cache.load(bad, model)


def test_forged_fingerprint_flags_and_missing_or_extra_tensors_are_refused(saved, tmp_path):
    model, _, path = saved
    header, tensors = read(path)
    alone = {k: v for k, v in tensors.items() if not k.startswith("sequence.fingerprint")}
    for h, t, message in [
        (header, alone, "has_fingerprint"),  # the flag without its tensors
        ({**header, "has_fingerprint": False}, tensors, "has_fingerprint"),  # the tensors without the flag
        (header, {**tensors, "sequence.fingerprint": tensors["sequence.fingerprint"] + 2**31}, "sequence.fingerprint"),
        (header, {**tensors, "sequence.fingerprint": tensors["sequence.fingerprint"] ^ 1}, "fingerprint"),
        (header, {k: v for k, v in tensors.items() if k != "layers.2.key_pos"}, "layers.2.key_pos"),
        (header, {**tensors, "layers.9.extra": torch.zeros(1)}, "layers.9.extra"),
        (header, {**tensors, "sequence.seen": tensors["sequence.seen"].int()}, "sequence.seen"),
    ]:
        with pytest.raises(CacheFileError, match=message):
            Cache.load(forge(path, tmp_path / "bad", h, t), model)
    loaded = Cache.load(forge(path, tmp_path / "ok", {**header, "has_fingerprint": False}, alone), model)
    assert loaded.seq.fingerprint is None  # honestly unknown tokens still load


# -- 4. keyed signature -------------------------------------------------------------------------------------------
def test_a_keyed_signature_refuses_unsigned_tampered_or_wrongly_keyed_files(saved, tmp_path):
    model, cache, path = saved
    key = b"k" * 32
    signed = save_cache(cache, tmp_path / "s.safetensors", model, key=key)
    assert all(torch.equal(a, b) for a, b in zip(state(cache), state(Cache.load(signed, model, key=key))))
    Cache.load(signed, model)  # without a key the signature is not checked
    with pytest.raises(CacheFileError, match="not signed"):
        Cache.load(path, model, key=key)
    with pytest.raises(CacheFileError, match="signature"):
        Cache.load(signed, model, key=b"another key")
    # tampering that keeps every unkeyed hash valid: one SSM state value changed, both hashes recomputed
    header, tensors = read(signed)
    tensors["layers.0.ssm"][0, 0, 0] += 1.0
    tampered = forge(signed, tmp_path / "t.safetensors", header, tensors)
    Cache.load(tampered, model)  # the sha256 detect corruption, not tampering: this loads
    with pytest.raises(CacheFileError, match="signature"):
        Cache.load(tampered, model, key=key)
    header.pop("signature")
    with pytest.raises(CacheFileError, match="not signed"):
        Cache.load(forge(signed, tmp_path / "u.safetensors", header, tensors), model, key=key)
    for bad in ("a str key", b"", 5):
        with pytest.raises(CacheError, match="key must be non-empty bytes"):
            save_cache(cache, tmp_path / "x", model, key=bad)
    assert not (tmp_path / "x").exists()


def test_cache_save_and_load_take_the_key(saved, tmp_path):
    model, cache, _ = saved
    path = cache.save(tmp_path / "s", model=model, key=b"secret")
    assert all(torch.equal(a, b) for a, b in zip(state(cache), state(Cache.load(path, model, key=b"secret"))))
    with pytest.raises(CacheFileError, match="signature"):
        Cache.load(path, model, key=b"other")


# -- 5. stored positions against the sequence state ---------------------------------------------------------------
def _edited(snap, layer, name, edit):
    from dataclasses import replace

    layers = list(snap.layers)
    tensors = {k: v.clone() for k, v in layers[layer].tensors.items()}
    edit(tensors[name])
    layers[layer] = replace(layers[layer], tensors=tensors)
    return replace(snap, layers=tuple(layers))


def _swap(t):
    t[0, [-1, -2]] = t[0, [-2, -1]]


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda t: t.__setitem__((0, -1), 99), "position 99"),  # beyond what the row has seen
        (lambda t: t.__setitem__((1, -1), t[1, -2]), "twice"),  # one position held twice
        (lambda t: t.__setitem__((0, -1), -5), "position -5"),
        (_swap, "increasing"),  # out of order for a pattern whose slots follow the columns
        (lambda t: t.__setitem__((0, 4), -1), "increasing|holds"),  # a token the next query needs dropped
        (lambda t: t.sub_(1).clamp_(min=-1), "holds"),  # every position shifted: the last token missing
    ],
)
def test_restore_refuses_stored_positions_inconsistent_with_the_sequence(saved, edit, why):
    cache = Cache.load(saved[2], saved[0])
    snap, before = cache.snapshot(), state(cache)
    with pytest.raises(CacheError, match=why):
        cache.restore(_edited(snap, 2, "key_pos", edit))
    assert all(torch.equal(a, b) for a, b in zip(before, state(cache)))
    cache.restore(snap)  # the untouched snapshot still restores


def test_restore_checks_preallocated_slots_and_recurrent_checkpoint_columns(models):
    model = models("jamba")[0]
    out = hc.generate(
        model,
        prompts(1, 9, seed=8),
        max_new_tokens=3,
        compile=False,
        cache=model.make_cache(1, {"recurrent": {"rollback": 3}}, max_length=16),
    )
    snap = out.cache.snapshot()
    with pytest.raises(CacheError, match="slot"):  # two positions in each other's slots
        out.cache.restore(_edited(snap, 2, "key_pos", lambda t: t.__setitem__((0, [0, 1]), t[0, [1, 0]])))
    trail = snap.layers[0].tensors["trail_columns"]
    assert trail.tolist() == [snap.columns - 3, snap.columns - 2, snap.columns - 1]  # what crop rewinds to
    edits = (lambda t: t.__setitem__(0, snap.columns), lambda t: t.copy_(t.flip(0)), lambda t: t.__setitem__(0, -2))
    for edit in edits:
        with pytest.raises(CacheError, match="trail_columns"):
            out.cache.restore(_edited(snap, 0, "trail_columns", edit))
    out.cache.restore(snap)


def test_a_cache_file_with_edited_positions_is_refused(saved, tmp_path):
    model, _, path = saved
    header, tensors = read(path)
    tensors["layers.2.key_pos"][0, -1] = 1000
    with pytest.raises(CacheFileError, match="position 1000"):
        Cache.load(forge(path, tmp_path / "bad", header, tensors), model)


# -- 6. the model identity covers every byte ----------------------------------------------------------------------
def test_a_cache_does_not_load_into_a_model_differing_in_the_middle_of_a_tensor(saved, checkpoints, tmp_path):
    path = saved[2]
    other = hc.from_pretrained(checkpoints("jamba"), dtype=torch.float32)
    Cache.load(path, other)  # the same weights: loads
    p = max(other.parameters(), key=lambda t: t.numel())
    assert p.numel() > 3 * 4096  # a value more than 4096 from both ends exists
    mid = p.numel() // 2
    value = p.view(-1)[mid].item()
    with torch.no_grad():
        p.view(-1)[mid] += 1e-3
    with pytest.raises(CacheFileError, match="weights_sha256"):
        Cache.load(path, other)
    with torch.no_grad():  # edited back in place: the same model object is hashed again, and matches
        p.view(-1)[mid] = value
    Cache.load(path, other)


def test_the_identity_of_a_bf16_model_covers_every_value(checkpoints):
    from hybridcache.cache.io.persistence import model_identity

    a = hc.from_pretrained(checkpoints("mamba"), dtype=torch.bfloat16)
    b = hc.from_pretrained(checkpoints("mamba"), dtype=torch.bfloat16)
    assert model_identity(a) == model_identity(b)
    p = max(b.parameters(), key=lambda t: t.numel())
    assert p.dtype == torch.bfloat16 and p.numel() > 3 * 4096
    with torch.no_grad():
        p.view(-1)[p.numel() // 2] = p.view(-1)[p.numel() // 2] * 2 + 1
    assert model_identity(a)["weights_sha256"] != model_identity(b)["weights_sha256"]

"""Generated hostile files: checkpoints (forged config.json fields, truncated / forged safetensors headers, links
out of the directory) and saved caches (forged headers with the unkeyed hashes recomputed, truncated payloads,
flipped bytes, forged tensors, links). Each load ends in a named error (ConfigError / CheckpointError /
CacheFileError) and leaves every file as it was (bytes and mtimes of the directories)."""

import json
import os
import shutil
import struct

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache
from tests.hostile.kit import files_unchanged, report, rng, run_cases
from tests.models.saved_cache import forge, read, save_jamba_cache
from tests.models.test_loading_hostile import shard_in_two

NAN = float("nan")


# -- checkpoints --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def original(checkpoints, tmp_path_factory):
    target = tmp_path_factory.mktemp("hostile_ckpt") / "gemma3"
    shutil.copytree(checkpoints("gemma3"), target)
    return target


def variant(original, root, i, files):
    """A checkpoint directory: `files` (name -> bytes) written, every other file of `original` hard-linked."""
    d = root / f"v{i}"
    d.mkdir()
    for f in original.iterdir():
        if f.name not in files:
            os.link(f, d / f.name)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


SHAPE_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
]
OTHER_FIELDS = [
    "sliding_window",
    "max_position_embeddings",
    "rms_norm_eps",
    "query_pre_attn_scalar",
    "torch_dtype",
    "dtype",
    "model_type",
    "layer_types",
    "rope_parameters",
    "hidden_activation",
    "tie_word_embeddings",
    "pad_token_id",
    "eos_token_id",
    "_sliding_window_pattern",
]
WRONG_TYPES = ["64", 64.5, [64], {"n": 64}, True, NAN, "", None]


def forged_config(r, config):
    c = dict(config)
    kind = r.randrange(6)
    if kind == 0:  # a size the weights do not have (or no size at all)
        name = r.choice(SHAPE_FIELDS)
        c[name] = r.choice([0, -1, -64, c[name] * 2, c[name] + 1, 10**12, 2**63, *WRONG_TYPES])
        return f"config {name}={c[name]!r}", c
    if kind == 1:
        name = r.choice([f for f in SHAPE_FIELDS + OTHER_FIELDS if f in c])
        del c[name]
        if name in (
            "dtype",
            "torch_dtype",
            "_sliding_window_pattern",
            "pad_token_id",
            "eos_token_id",
            "tie_word_embeddings",
            "hidden_activation",
            "query_pre_attn_scalar",
            "rms_norm_eps",
            "rope_parameters",
            "max_position_embeddings",
            "head_dim",
            "layer_types",
        ):
            c["model_type"] = r.choice(["gemma9_text", "", 3, None])  # a removal HF has a default for: break the type
        return f"config without {name} (model_type {c.get('model_type')!r})", c
    if kind == 2:
        name = r.choice(["torch_dtype", "dtype"])
        c[name] = r.choice(["float33", "Tensor", "", 5, ["float32"], "torch.nn", "float32 "])
        return f"config {name}={c[name]!r}", c
    if kind == 3:
        c["layer_types"] = r.choice(
            [["sliding_attention"] * 3, ["nope"] * 4, "full_attention", [1, 2, 3, 4], ["full_attention"] * 5, []]
        )
        return f"config layer_types={c['layer_types']!r}", c
    if kind == 4:
        name = r.choice(["sliding_window", "max_position_embeddings", "rms_norm_eps", "query_pre_attn_scalar"])
        c[name] = r.choice([0, -1, -(10**9), NAN, "8", [8], True])  # (inf: HF's configs may hold infinities)
        return f"config {name}={c[name]!r}", c
    c["model_type"] = r.choice(["gemma9_text", "llama", "", 5, None, ["gemma3_text"], "../../etc"])
    return f"config model_type={c['model_type']!r}", c


def broken_json(r, raw):
    kind = r.randrange(5)
    if kind == 0:
        return "config.json truncated", raw[: r.randrange(len(raw))]
    if kind == 1:
        return "config.json a list", json.dumps([1, 2]).encode()
    if kind == 2:
        return "config.json not UTF-8", b"\xff\xfe" + raw[2:]
    if kind == 3:
        return "config.json nested 100000 deep", b"[" * 100000 + b"]" * 100000
    return "config.json a string", json.dumps("gemma3").encode()


def forged_safetensors(r, data):
    """model.safetensors truncated, its header length or its JSON header forged (data bytes unchanged)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    kind = r.randrange(6)
    if kind == 0:
        cut = r.choice([0, 1, 7, 8, r.randrange(9, 8 + n), r.randrange(8 + n, len(data))])
        return f"safetensors truncated at {cut}", data[:cut]
    if kind == 1:
        value = r.choice([0, 1, len(data), len(data) * 2, 2**63, 2**64 - 1, n - 1, n + 1])
        return f"safetensors header length {value}", struct.pack("<Q", value) + data[8:]
    if kind == 2:
        at = r.randrange(8, 8 + n)
        flipped = bytearray(data)
        flipped[at] ^= 1 << r.randrange(8)
        try:
            json.loads(bytes(flipped[8 : 8 + n]))
            same = False
        except ValueError:
            same = True
        if not same:  # a flip that still parses may be harmless (a digit of an offset that... ) -> forge instead
            kind = 3
        else:
            return f"safetensors header byte {at} flipped", bytes(flipped)
    names = sorted(k for k in header if k != "__metadata__")
    name = r.choice(names)
    t = dict(header[name])
    if kind == 3:
        t["dtype"] = r.choice(["F33", "", 5, None, "I64", "F64", "BOOL"] if t["dtype"] == "F32" else ["F33"])
    elif kind == 4:
        t["shape"] = r.choice([[10**12, 10**12], [-1], "64", [1.5], t["shape"] + [2], [s * 2 for s in t["shape"]]])
    else:
        a, b = t["data_offsets"]
        t["data_offsets"] = r.choice([[a, len(body) + 8], [-8, b], [b, a], [a, 2**63], [a], "0", [a, b + 4]])
    header = {**header, name: t}
    text = json.dumps(header).encode()
    return f"safetensors {name}: {t}", struct.pack("<Q", len(text)) + text + body


def test_generated_bad_checkpoints(original, tmp_path):
    r = rng("checkpoints")
    raw_config = (original / "config.json").read_bytes()
    config = json.loads(raw_config)
    weights = (original / "model.safetensors").read_bytes()
    cases = []
    for i in range(240):
        which = r.random()
        if which < 0.5:
            desc, c = forged_config(r, config)
            files = {"config.json": json.dumps(c).encode()}
        elif which < 0.6:
            desc, data = broken_json(r, raw_config)
            files = {"config.json": data}
        else:
            desc, data = forged_safetensors(r, weights)
            files = {"model.safetensors": data}
        d = variant(original, tmp_path, i, files)
        cases.append((desc, lambda d=d: hc.from_pretrained(d)))
    unchanged = files_unchanged(tmp_path, original)
    problems = run_cases("checkpoints", cases, unchanged)
    assert not problems, report(problems, len(cases))
    assert unchanged.digests()


def test_linked_and_misplaced_checkpoint_files(original, tmp_path):
    """Shards, index and config linked out of the directory, dangling or looping links, index entries that climb
    out, point at absolute paths or are not names."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.safetensors").write_bytes((original / "model.safetensors").read_bytes())
    cases = []
    for i, how in enumerate(
        [
            "shard out",
            "shard dangling",
            "shard loop",
            "index out",
            "config out",
            "dir link",
            "entry ../",
            "entry absolute",
            "entry int",
            "entry empty",
            "weight_map list",
            "shard /dev/null",
            "shard a directory",
            "single file out",
            "config /dev/null",
        ]
    ):
        d = tmp_path / f"c{i}"
        shutil.copytree(original, d)
        index = d / "model.safetensors.index.json"
        if how not in ("single file out", "config out", "config /dev/null"):
            shard_in_two(d)
        if how == "shard out":
            os.replace(d / "b.safetensors", outside / f"b{i}.safetensors")
            os.symlink(outside / f"b{i}.safetensors", d / "b.safetensors")
        elif how == "shard dangling":
            os.unlink(d / "b.safetensors")
            os.symlink(d / "nowhere.safetensors", d / "b.safetensors")
        elif how == "shard loop":
            os.unlink(d / "b.safetensors")
            os.symlink(d / "c.safetensors", d / "b.safetensors")
            os.symlink(d / "b.safetensors", d / "c.safetensors")
        elif how == "index out":
            os.replace(index, outside / f"index{i}.json")
            os.symlink(outside / f"index{i}.json", index)
        elif how == "config out":
            os.replace(d / "config.json", outside / f"config{i}.json")
            os.symlink(outside / f"config{i}.json", d / "config.json")
        elif how == "config /dev/null":
            os.unlink(d / "config.json")
            os.symlink("/dev/null", d / "config.json")
        elif how == "dir link":
            os.replace(d / "b.safetensors", outside / f"d{i}.safetensors")
            os.symlink(outside, d / "w")
            index.write_text(index.read_text().replace('"b.safetensors"', f'"w/d{i}.safetensors"'))
        elif how.startswith("entry"):
            target = {
                "entry ../": json.dumps("../outside/secret.safetensors"),
                "entry absolute": json.dumps(str(outside / "secret.safetensors")),
                "entry int": "5",
                "entry empty": '""',
            }[how]
            index.write_text(index.read_text().replace('"b.safetensors"', target))
        elif how == "weight_map list":
            index.write_text(json.dumps({"metadata": {}, "weight_map": ["a.safetensors"]}))
        elif how == "shard /dev/null":
            os.unlink(d / "b.safetensors")
            os.symlink("/dev/null", d / "b.safetensors")
        elif how == "shard a directory":
            os.unlink(d / "b.safetensors")
            (d / "b.safetensors").mkdir()
        elif how == "single file out":
            os.replace(d / "model.safetensors", outside / f"m{i}.safetensors")
            os.symlink(outside / f"m{i}.safetensors", d / "model.safetensors")
        cases.append((how, lambda d=d: hc.from_pretrained(d)))
    unchanged = files_unchanged(tmp_path, original)
    problems = run_cases("checkpoints", cases, unchanged)
    assert not problems, report(problems, len(cases))
    assert unchanged.digests()


# -- saved caches -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    model, _, path = save_jamba_cache(models, tmp_path_factory.mktemp("hostile_saved"))
    return model, path


def _paths(node, prefix=()):
    """Every path into a JSON tree (dict keys and list indices)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


HEADER_VALUES = [None, -1, 0, 10**12, 2**63, 1.5, NAN, "x", "", True, [], {}, [1, 2], {"a": 1}]


def forged_header(r, header):
    """The header with one field (anywhere in it) removed or replaced by a value of another kind or size."""
    h = json.loads(json.dumps(header))
    # not the layers' spec fields: a self-consistent spec (other parameters, a default left out) is a valid cache
    # of another configuration, which only a keyed signature (key=) tells from the saved one
    paths = [
        p
        for p in _paths(h)
        if p and p[0] not in ("payload_sha256", "header_sha256", "signature") and not (len(p) > 3 and p[2] == "spec")
    ]
    path = r.choice(paths)
    node = h
    for p in path[:-1]:
        node = node[p]
    old = node[path[-1]]
    if r.random() < 0.2 and isinstance(node, dict):
        del node[path[-1]]
        return f"header without {'.'.join(map(str, path))}", h
    choices = [v for v in HEADER_VALUES if type(v) is not type(old) or (isinstance(v, int) and v != old)]
    if isinstance(old, int) and not isinstance(old, bool):
        choices += [old + 1, old - 1, -old - 1, old * 1000]
    if isinstance(old, str):
        choices += [old + "x", old[:-1], old.upper() if old.upper() != old else old + "_"]
    node[path[-1]] = r.choice(choices)
    return f"header {'.'.join(map(str, path))}={node[path[-1]]!r} (was {old!r})"[:200], h


def forged_tensors(r, tensors):
    t = dict(tensors)
    name = r.choice(sorted(t))
    kind = r.randrange(5)
    if name == "sequence.fingerprint_history" and kind == 0:
        kind = 1  # optional (it lets crop keep the fingerprint): a file without it is valid
    if kind == 0:
        del t[name]
    elif kind == 1:
        t[name] = t[name].to(
            r.choice([torch.float64, torch.int32, torch.float16, torch.uint8])
            if t[name].dtype != torch.float64
            else torch.float32
        )
    elif kind == 2:
        t[name] = torch.cat([t[name], t[name][:1]]) if t[name].dim() else t[name].reshape(1)
    elif kind == 3:
        t[name] = t[name].reshape(-1) if t[name].dim() > 1 else t[name].reshape(1, -1).repeat(2, 1)
    else:
        t[name + r.choice(["_", ".x", "2"])] = torch.zeros(2)
    return f"tensor {name} forged ({kind})", t


def test_generated_bad_cache_files(saved, tmp_path):
    model, path = saved
    r = rng("cache files")
    data = path.read_bytes()
    header, tensors = read(path)
    n = struct.unpack("<Q", data[:8])[0]
    cases = []
    for i in range(640):
        out = tmp_path / f"f{i}.safetensors"
        which = r.random()
        if which < 0.35:
            desc, h = forged_header(r, header)
            forge(path, out, h, tensors)
        elif which < 0.5:
            desc, t = forged_tensors(r, tensors)
            forge(path, out, header, t)
        elif which < 0.7:
            cut = r.choice([0, 4, 8, r.randrange(9, 8 + n), r.randrange(8 + n, len(data))])
            desc = f"truncated at {cut} of {len(data)}"
            out.write_bytes(data[:cut])
        else:
            flipped = bytearray(data)
            for _ in range(r.choice([1, 1, 1, 2, 8])):
                at = r.randrange(len(data)) if r.random() < 0.7 else r.randrange(8 + n, len(data))
                flipped[at] ^= 1 << r.randrange(8)
            if bytes(flipped) == data:
                flipped[-1] ^= 1
            desc = "bytes flipped"
            out.write_bytes(bytes(flipped))
        cases.append((f"{desc} ({out.name})", lambda out=out: Cache.load(out, model)))
    # links and things that are no cache file
    (tmp_path / "dir.safetensors").mkdir()
    for name, target in [
        ("null", "/dev/null"),
        ("dangling", tmp_path / "none"),
        ("dir", tmp_path / "dir.safetensors"),
        ("source", __file__),
    ]:
        link = tmp_path / f"link_{name}.safetensors"
        os.symlink(target, link)
        cases.append((f"a link to {target}", lambda link=link: Cache.load(link, model)))
    loop = tmp_path / "loop.safetensors"
    os.symlink(tmp_path / "loop2.safetensors", loop)
    os.symlink(loop, tmp_path / "loop2.safetensors")
    cases.append(("a link loop", lambda: Cache.load(loop, model)))
    # bad arguments with a good file
    for kwargs in [
        dict(batch_size=3),
        dict(batch_size=0),
        dict(batch_size="2"),
        dict(batch_size=1.5),
        dict(device="cuda:99"),
        dict(device="nope"),
        dict(cache_config={"attention": {"type": "nope"}}),
        dict(cache_config=5),
        dict(key="a str key"),
        dict(key=b""),
        dict(key=5),
        dict(key=b"k"),
    ]:
        cases.append((f"Cache.load({kwargs})", lambda kwargs=kwargs: Cache.load(path, model, **kwargs)))
    for other in ["x", None, 5, torch.nn.Linear(2, 2)]:
        cases.append((f"Cache.load(model={other!r})", lambda other=other: Cache.load(path, other)))
    unchanged = files_unchanged(tmp_path, path.parent)
    problems = run_cases("cache files", cases, unchanged)
    assert len(cases) >= 650 and not problems, report(problems, len(cases))
    assert unchanged.digests()

"""Generated bad calls to the Cache API (indexing, crop, repeat, select, reorder, blocks, layer updates, restore,
building): each a named CacheError with the cache bit-identical to its snapshot afterwards.

The caches: tests/cache/helpers.hybrid_cache (all seven native layer types, left-padded rows), preallocated or
dynamic, an attention-only one (where crop is possible), one with int8 keys/values and int8 recurrent states, and
one with an attention-sink layer and recurrent rollback."""

from dataclasses import replace

import pytest
import torch

from hybridcache.cache import Cache
from tests.cache.helpers import NATIVE, feed, hybrid_cache, state_equal
from tests.hostile.kit import Accepted, report, rng, run_cases

VALID = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def _fed(cache, valid=VALID):
    feed(cache, 5, valid=valid)
    return cache


CACHES = {
    "static": lambda: _fed(hybrid_cache(batch=2, max_length=16)),
    "dynamic": lambda: _fed(hybrid_cache(batch=2)),
    "attention only": lambda: _fed(hybrid_cache(batch=2, types=("full", "sliding", "chunked"))),
    "int8": lambda: _fed(
        Cache.build(list(NATIVE.values()), 2, {"attention": {"storage": "int8"}, "recurrent": {"state_codec": "int8"}})
    ),
    "sink+rollback": lambda: _fed(
        Cache.build(
            list(NATIVE.values()), 2, {"full": {"type": "sink", "window": 4, "sinks": 1}, "recurrent": {"rollback": 2}}
        )
    ),
}

NAN, INF = float("nan"), float("inf")
NOT_INTS = [
    1.5,
    NAN,
    INF,
    -INF,
    "3",
    "",
    None,
    True,
    False,
    [1],
    (2,),
    {1: 2},
    b"1",
    1 + 0j,
    object(),
    torch.tensor(1.5),
    torch.tensor([1, 2]),
    torch.tensor(NAN),
    torch.zeros(2, 2),
    torch.ones(1, dtype=torch.bool),
]
HUGE = [10**12, 10**18, 2**63 - 1, 2**63, 2**64, 10**30, 10**100]
NEGATIVE = [-1, -2, -7, -(2**31), -(2**63), -(2**64), -(10**30)]
DTYPES = [
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.int8,
]


def bad_size(r, columns=None):
    """A count that is no usable size: not an int, negative, huge or (for crop) past the columns."""
    kind = r.random()
    if kind < 0.4:
        return r.choice(NOT_INTS)
    if kind < 0.6:
        return r.choice(NEGATIVE) if r.random() < 0.5 else -r.randint(1, 10**6)
    if kind < 0.8 or columns is None:
        return r.choice(HUGE) if r.random() < 0.5 else r.randint(10**12, 10**40)
    return columns + r.randint(1, 1000)


def bad_row_index(r, batch, same_size):
    """A row index that is refused (for select and reorder alike unless noted)."""
    n = batch if same_size else r.randint(1, 5)
    kind = r.randrange(12)
    ok = [r.randrange(batch) for _ in range(n)]
    at = r.randrange(n)
    if kind == 0:  # out of range
        ok[at] = r.choice([batch, batch + r.randint(1, 100), r.choice(HUGE[:4]), -1, -batch - 1, -r.randint(1, 10**9)])
        return ok
    if kind == 1:  # a value a tensor cannot even hold
        ok[at] = r.choice([2**63, 2**64, 10**30, -(2**64)])
        return ok
    if kind == 2:
        return [float(i) + r.choice([0.0, 0.5]) for i in ok]
    if kind == 3:
        ok[at] = r.choice([NAN, INF, None, "0", True, [0], b"\x00"])
        return ok
    if kind == 4:
        return r.choice([[], (), torch.tensor([], dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)])
    if kind == 5:
        return torch.tensor(
            ok, dtype=r.choice([torch.float32, torch.float64, torch.bool, torch.complex64, torch.float16])
        )
    if kind == 6:
        return torch.tensor(ok).reshape(1, -1) if r.random() < 0.5 else torch.tensor(ok[0])
    if kind == 7:
        return torch.tensor(ok, device="meta")
    if kind == 8:
        return r.choice(["01", None, 0.5, {0: 1}, object(), set(ok), range(-1, batch)])
    if kind == 9:
        return [True, False][:n] if n <= 2 else [True] * n
    if kind == 10 and same_size:  # a reorder of another length
        return [r.randrange(batch) for _ in range(r.choice([1, batch + 1, batch + 3]))]
    bad = torch.tensor(ok, dtype=torch.float32)
    bad[at] = NAN
    return bad


def bad_mask(r, batch, tokens):
    """A `valid` mask for a block of `tokens` that is refused: wrong shape / type / values / device, or padding
    after real tokens (both rows of these caches already hold real tokens, so any 0 is)."""
    kind = r.randrange(8)
    if kind == 0:
        shape = r.choice([(batch, tokens + r.randint(1, 3)), (batch + 1, tokens), (tokens,), (batch, tokens, 1), ()])
        return torch.ones(shape, dtype=torch.long)
    if kind == 1:
        m = torch.ones(batch, tokens, dtype=torch.long)
        m[r.randrange(batch), r.randrange(tokens)] = r.choice([2, -1, 7, 2**40])
        return m
    if kind == 2:
        return torch.full((batch, tokens), r.choice([0.5, 1.0, NAN, INF]))
    if kind == 3:
        return torch.ones(batch, tokens, dtype=torch.long, device="meta")
    if kind == 4:
        return r.choice([[[1] * tokens] * batch, "1", 1, object()])
    if kind == 5:
        return torch.ones(batch, tokens, dtype=r.choice([torch.complex64, torch.float16]))
    m = torch.ones(batch, tokens, dtype=r.choice([torch.long, torch.bool, torch.int32]))
    m[r.randrange(batch), r.randrange(tokens)] = 0
    return m


def bad_tensor_like(r, t, dims_ok=True):
    """A tensor (or not) that differs from `t` in rank, a dim, dtype or device."""
    kind = r.randrange(6)
    shape = list(t.shape)
    if kind == 0 and shape:
        d = r.choice([0, len(shape) - 1] if len(shape) >= 3 else [0])  # the batch or a fixed inner size
        shape[d] = r.choice([0, shape[d] + r.randint(1, 3), max(shape[d] - 1, 0) if shape[d] > 1 else 2])
        return torch.randn(shape).to(t.dtype) if t.dtype.is_floating_point else torch.zeros(shape, dtype=t.dtype)
    if kind == 1:
        shape = shape + [1] if r.random() < 0.5 else shape[:-1]
        return torch.zeros(shape, dtype=t.dtype)
    if kind == 2:
        dtype = r.choice([d for d in DTYPES if d != t.dtype])
        return torch.zeros(t.shape, dtype=dtype)
    if kind == 3:
        return torch.zeros(t.shape, dtype=t.dtype, device="meta")
    if kind == 4:
        return r.choice(
            [
                t.tolist(),
                None,
                0.0,
                "tensor",
                t.numpy() if t.device.type == "cpu" and t.dtype not in (torch.bfloat16,) else None,
            ]
        )
    return torch.zeros(t.shape, dtype=t.dtype).unsqueeze(0).expand(3, *t.shape)  # an extra leading dimension


def _block_then(cache, tokens, call):
    """Open a block of `tokens`, make the bad call; a call that returns is Accepted (the block is aborted)."""

    def run():
        with cache.block(None, tokens):
            call()
            raise Accepted

    return run


def attention_update(r, cache):
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if layer.kind == "attention"]
    i, layer = r.choice(layers)
    t = r.randint(1, 3)
    s = layer.spec
    k = torch.randn(cache.batch_size, s.num_kv_heads, t, s.head_dim)
    which = r.randrange(5)
    if which == 0:
        args = (bad_tensor_like(r, k), k.clone())
    elif which == 1:
        args = (k, bad_tensor_like(r, k))
    elif which == 2:
        bad = bad_tensor_like(r, k)
        args = (bad, bad)
    elif which == 3:  # a block of another length than the one open
        k2 = torch.randn(cache.batch_size, s.num_kv_heads, t + r.randint(1, 4), s.head_dim)
        args = (k2, k2.clone())
    else:
        args = r.choice([(None, None), (k.numpy(), k.numpy()), (1.0, 1.0), ("k", "v")])
    return f"layer {i} update {[type(a).__name__ + str(tuple(getattr(a, 'shape', ()))) for a in args]}", _block_then(
        cache, t, lambda: cache[i].update(*args)
    )


def recurrent_update(r, cache):
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if layer.kind != "attention"]
    i, layer = r.choice(layers)
    states = {n: torch.zeros_like(t) for n, t in layer.states.items()}
    which = r.randrange(5)
    name = r.choice(sorted(states))
    if which == 0:
        del states[name]
    elif which == 1:
        states[r.choice(["extra", "ssm_state", "conv_state", "h", name + "_"])] = torch.zeros(2, 2)
    elif which in (2, 3):
        states[name] = bad_tensor_like(r, states[name])
    else:
        return f"layer {i} positional update", _block_then(cache, 1, lambda: cache[i].update(*states.values()))
    return f"layer {i} update {sorted(states)} ({name}: {type(states.get(name)).__name__})", _block_then(
        cache, 1, lambda: cache[i].update(**states)
    )


def index(r, cache):
    n = len(cache)
    key = r.choice(
        [
            r.choice([n, n + r.randint(1, 100), -n - 1, -n - r.randint(1, 10**6), *HUGE, *NEGATIVE[3:]]),
            r.choice(["x", "0", "", None, 1.5, NAN, True, False, b"\x00", (0, 1), [0], {0: 0}, object(), 1j, Ellipsis]),
            r.choice(
                [
                    torch.tensor([1, 2]),
                    torch.tensor(1.5),
                    torch.tensor(n + 3),
                    torch.tensor(True),
                    torch.tensor(NAN),
                    torch.zeros(2, 2, dtype=torch.long),
                ]
            ),
        ]
    )
    return f"cache[{key!r}]", lambda: cache[key]


def crop(r, cache):
    n = bad_size(r, cache.columns)
    return f"crop({n!r})", lambda: cache.crop(n)


def repeat(r, cache):
    n = bad_size(r)
    return f"repeat({n!r})", lambda: cache.repeat(n)


def select(r, cache):
    idx = bad_row_index(r, cache.batch_size, same_size=False)
    return f"select({idx!r})", lambda: cache.select(idx)


def reorder(r, cache):
    idx = bad_row_index(r, cache.batch_size, same_size=True)
    return f"reorder({idx!r})", lambda: cache.reorder(idx)


def block(r, cache):
    if r.random() < 0.5:
        tokens = bad_size(r)
        if isinstance(tokens, int) and not isinstance(tokens, bool) and 0 < tokens < 2**62:
            tokens = r.choice([0, -1, 2**62, 2**63, 2**64])  # a positive count is a block; past int64 it is not
        return f"block(None, {tokens!r})", _open(cache, None, tokens)
    t = r.randint(1, 4)
    m = bad_mask(r, cache.batch_size, t)
    return f"block({m!r}, {t})", _open(cache, m, t)


def _open(cache, valid, tokens):
    def run():
        with cache.block(valid, tokens):
            raise Accepted

    return run


def restore(r, cache):
    snap = cache.snapshot()
    kind = r.randrange(9)
    if kind == 0:
        seen = r.choice(
            [
                snap.seen.float(),
                snap.seen.int(),
                snap.seen[:1],
                torch.cat([snap.seen, snap.seen]),
                snap.seen - r.randint(snap.columns + 1, 10**6),
                snap.seen + r.randint(snap.columns + 1, 10**9),
                snap.seen.reshape(1, -1),
                snap.seen.to("meta"),
                snap.seen.tolist(),
                None,
                torch.tensor([], dtype=torch.long),
            ]
        )
        return "restore(seen edited)", lambda: cache.restore(replace(snap, seen=seen))
    if kind == 1:
        columns = r.choice(
            [
                -1,
                float(snap.columns),
                True,
                str(snap.columns),
                None,
                NAN,
                *HUGE[:3],
                snap.columns + r.randint(1, 9),
                snap.columns - r.randint(1, 3),
            ]
        )
        return f"restore(columns={columns!r})", lambda: cache.restore(replace(snap, columns=columns))
    if kind == 2:
        layers = r.choice(
            [
                snap.layers[:-1],
                snap.layers + snap.layers[:1],
                tuple(reversed(snap.layers)),
                (),
                (None,) * len(snap.layers),
                snap.layers[1:] + snap.layers[:1],
            ]
        )
        return "restore(layers shuffled)", lambda: cache.restore(replace(snap, layers=layers))
    if kind == 3:
        other = r.choice([None, {}, "snapshot", cache, snap.layers, object()])
        return f"restore({type(other).__name__})", lambda: cache.restore(other)
    if kind == 4:
        field = r.choice(["fingerprint", "history"])
        value = r.choice([torch.zeros(3, dtype=torch.long), torch.zeros(2, 99, dtype=torch.long), "x", [1, 2]])
        return f"restore({field} of another shape)", lambda: cache.restore(replace(snap, **{field: value}))
    # a layer's tensors: one changed in shape / dtype / device, removed, or an extra one
    i = r.randrange(len(snap.layers))
    layer = snap.layers[i]
    tensors = dict(layer.tensors)
    name = r.choice(sorted(tensors))
    if kind == 5:
        del tensors[name]
    elif kind == 6:
        tensors[name + r.choice(["_", "2", ".x"])] = torch.zeros(2)
    else:
        t = tensors[name]
        bad = bad_tensor_like(r, t)
        if isinstance(bad, torch.Tensor) and bad.shape == t.shape and bad.dtype == t.dtype and bad.device == t.device:
            bad = None
        tensors[name] = bad
    desc = (
        f"restore(layer {i} tensor {name!r} {type(tensors.get(name)).__name__} "
        f"{tuple(getattr(tensors.get(name), 'shape', ()))} {getattr(tensors.get(name), 'dtype', '')})"
    )
    edited = replace(snap, layers=(*snap.layers[:i], replace(layer, tensors=tensors), *snap.layers[i + 1 :]))
    return desc, lambda: cache.restore(edited)


def positions(r, cache):
    """Stored key positions edited in a snapshot (kept dtype and shape): beyond what a row saw, negative, repeated."""
    snap = cache.snapshot()
    layers = [(i, s) for i, s in enumerate(snap.layers) if "key_pos" in s.tensors]
    i, layer = r.choice(layers)
    pos = layer.tensors["key_pos"].clone()
    row = r.randrange(pos.shape[0])
    last = pos.shape[1] - 1
    kind = r.randrange(3)
    if kind == 0:
        pos[row, last] = int(snap.seen[row]) + r.randint(0, 10**6)  # position seen or beyond: never stored
    elif kind == 1:
        pos[row, last] = -r.randint(2, 10**6)
    else:
        pos[row, last] = pos[row, last - 1] if last else 10**9
    if torch.equal(pos, layer.tensors["key_pos"]):
        pos[row, last] = 10**9
    edited = replace(
        snap,
        layers=(*snap.layers[:i], replace(layer, tensors={**layer.tensors, "key_pos": pos}), *snap.layers[i + 1 :]),
    )
    return f"restore(layer {i} key_pos row {row} = {pos[row].tolist()})", lambda: cache.restore(edited)


def build(r, _cache):
    kind = r.randrange(4)
    natives = list(NATIVE.values())
    if kind == 0:
        batch = bad_size(r)
        return f"Cache.build(batch={batch!r})", lambda: Cache.build(natives, batch)
    if kind == 1:
        n = bad_size(r)
        if n is None:
            n = 0
        return f"Cache.build(max_length={n!r})", lambda: Cache.build(natives, 2, max_length=n)
    if kind == 2:
        device = r.choice(["cuda:99", "nope", 3.5, "cpu:x", "tpu", -1, [], "cuda:-1", "cpu;rm"])
        return f"Cache.build(device={device!r})", lambda: Cache.build(natives, 2, device=device)
    config = bad_cache_config(r)
    return f"Cache.build(cache_config={config!r})", lambda: Cache.build(natives, 2, config)


def bad_cache_config(r):
    """A cache config that cannot be resolved: unknown names, bad values, layers that do not exist."""
    section = r.choice(["attention", "recurrent", "full", "sliding", "chunked", "mamba", "layers.0", "layers.3"])
    kind = r.randrange(7)
    if kind == 0:
        wrong_kind = "full" if section in ("recurrent", "mamba", "layers.3") else "mamba"  # a type of the other kind
        body = {"type": r.choice(["nope", "ful", "slidng", wrong_kind, 5, ""])}
    elif kind == 1:
        body = {
            r.choice(["window", "chunk_size", "max_length", "sinks", "rollback"]): r.choice(
                [0, -1, 1.5, "8", True, NAN, [4], 10**30]
            )
        }
    elif kind == 2:
        body = {"storage": r.choice(["int9", "kivi2", 8, "", None])}
    elif kind == 3:
        body = {"state_codec": r.choice(["int3", "fp9", 1, "", []])}
    elif kind == 4:
        body = {r.choice(["windw", "typ", "bogus", "chunksize"]): 4}
    elif kind == 5:
        return r.choice(
            [
                "int8",
                5,
                [1, 2],
                {"layers": {"99": {"type": "full"}}},
                {"layers": {"-9": {"type": "full"}}},
                {"layers": {"x": {}}},
                {"nonsense": {}},
                {"attention": "sliding"},
                {"layers": [1]},
            ]
        )
    else:
        body = r.choice(["sliding", 4, [1], 1.5])
    if section.startswith("layers."):
        return {"layers": {section.split(".")[1]: body}}
    return {section: body}


GENERATORS = {  # name -> (generator, inputs per cache)
    "index": (index, 30),
    "crop": (crop, 30),
    "repeat": (repeat, 20),
    "select": (select, 30),
    "reorder": (reorder, 30),
    "block": (block, 30),
    "attention update": (attention_update, 50),
    "recurrent update": (recurrent_update, 40),
    "restore": (restore, 50),
    "restore positions": (positions, 15),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_generated_bad_cache_calls_are_named_errors_that_change_nothing(name):
    cache = CACHES[name]()
    before = cache.snapshot()
    problems, n = [], 0

    def unchanged():
        if state_equal(cache.snapshot(), before):
            return None
        cache.restore(before)  # so that the next input starts from the same cache
        return "the cache changed"

    for op, (generate, count) in GENERATORS.items():
        r = rng(f"cache api:{name}:{op}")
        if op == "recurrent update" and all(layer.kind == "attention" for layer in cache.layers):
            generate, count = attention_update, count  # no recurrent layer here: as many attention updates
        cases = [generate(r, cache) for _ in range(count)]
        n += len(cases)
        problems += run_cases("cache api", [(f"[{name}] {d}", c) for d, c in cases], unchanged)
    assert n >= 300 and not problems, report(problems, n)


def test_generated_bad_cache_builds_are_named_errors():
    r = rng("cache api:build")
    cases = [build(r, None) for _ in range(150)]
    problems = run_cases("cache api", cases)
    assert not problems, report(problems, len(cases))

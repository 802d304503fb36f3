"""examples/cache_demo.py: a chunked layer's holding is explained, including the 0 B right after a chunk completes."""

import importlib.util
from pathlib import Path

from hybridcache.cache import Cache

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cache_demo.py"


def demo():
    spec = importlib.util.spec_from_file_location("cache_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the demo's own run is under __main__, so nothing runs here
    return module


def chunked_cache(d, tokens: int) -> Cache:
    cache = Cache.build(d.native, 1, {"full": {"type": "chunked", "chunk_size": 8}})
    d.run(cache, prompt=tokens - 2, decode=2)
    return cache


def test_exact_multiple_of_the_chunk_holds_nothing_and_says_why():
    d = demo()
    cache = chunked_cache(d, 16)
    held = [layer.nbytes() for layer in cache if layer.type_name == "chunked"]
    assert held == [0, 0]
    (note,) = d.chunked_notes(cache)
    assert note.startswith("chunked: holds 0 B: token 16 completed chunk 2 (chunk size 8)")
    assert "the next token starts a new chunk" in note


def test_inside_a_chunk_holds_its_tokens():
    d = demo()
    cache = chunked_cache(d, 13)
    # 13 = one full chunk of 8 + 5 tokens: keys and values of those 5, float32, 8 heads of 64
    held = [layer.nbytes() for layer in cache if layer.type_name == "chunked"]
    assert held == [2 * 5 * 8 * 64 * 4] * 2
    (note,) = d.chunked_notes(cache)
    assert note == "chunked: holds the 5 tokens of the current chunk 2 (chunk size 8, 13 seen)"


def test_no_chunked_layer_no_note():
    d = demo()
    cache = Cache.build(d.native, 1, None)
    d.run(cache, prompt=6, decode=1)
    assert d.chunked_notes(cache) == []

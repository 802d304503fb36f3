"""Property-based exactness on whole models: for random families, strategies, left padding, prefill splits and a
continuation point, cached generation (continued from its returned cache) equals the use_cache=False recompute
with the same patterns, in float64 (to 1e-9)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache as hc
from hybridcache.checkpoints.tiny import FAMILIES

F64 = {"recurrent": {"state_dtype": torch.float64}}


@st.composite
def scenarios(draw):
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 18))
    strategy = draw(st.sampled_from(["native", "sliding", "chunked", "sink"]))
    config = {
        "native": {},
        "sliding": {"attention": {"type": "sliding", "window": draw(st.integers(1, 9))}},
        "chunked": {"attention": {"type": "chunked", "chunk_size": draw(st.integers(1, 9))}},
        "sink": {"attention": {"type": "sink", "window": draw(st.integers(1, 6)), "sinks": draw(st.integers(1, 3))}},
    }[strategy]
    return dict(
        family=draw(st.sampled_from(FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
        batch=batch,
        length=length,
        pads=[draw(st.integers(0, length - 1)) for _ in range(batch)],
        config={**config, **F64},
        chunk=draw(st.one_of(st.none(), st.integers(1, length))),
        first=draw(st.integers(1, 4)),
        second=draw(st.integers(1, 4)),
        static=draw(st.booleans()),
    )


@settings(max_examples=max(20, settings.default.max_examples // 5))
@given(scenarios())
def test_cached_and_continued_generation_equals_the_recompute(models, s):
    model, _ = models(s["family"], torch.float64)
    g = torch.Generator().manual_seed(s["seed"])
    ids = torch.randint(3, 384, (s["batch"], s["length"]), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(s["pads"]):
        mask[row, :pad] = 0
    total = s["first"] + s["second"]
    oracle = hc.generate(
        model, ids, attention_mask=mask, max_new_tokens=total, cache_config=s["config"], use_cache=False
    )
    cache = model.make_cache(s["batch"], s["config"], max_length=s["length"] + total if s["static"] else None)
    first = hc.generate(
        model, ids, attention_mask=mask, max_new_tokens=s["first"], cache=cache, prefill_chunk_size=s["chunk"]
    )
    whole_mask = torch.cat([mask, torch.ones(s["batch"], s["first"], dtype=mask.dtype)], 1)
    second = hc.generate(model, first.sequences, attention_mask=whole_mask, max_new_tokens=s["second"], cache=cache)
    assert torch.equal(second.sequences, oracle.sequences)
    logits = torch.cat([first.logits, second.logits], 1)
    assert (logits - oracle.logits).abs().max().item() < 1e-9


@st.composite
def rollbacks(draw):
    batch, length, k = draw(st.integers(1, 2)), draw(st.integers(2, 12)), draw(st.integers(1, 4))
    return dict(
        family=draw(st.sampled_from(FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
        batch=batch,
        length=length,
        pads=[draw(st.integers(0, length - 1)) for _ in range(batch)],
        k=k,
        fed=draw(st.integers(1, 5)),
        steps=draw(st.booleans()),
        back=draw(st.integers(0, k)),
        new=draw(st.integers(1, 3)),
    )


@settings(max_examples=max(10, settings.default.max_examples // 20))
@given(rollbacks())
def test_crop_within_the_rollback_then_continue_equals_the_recompute(models, s):
    """Feed a left-padded prompt and more tokens (one block or decode steps), crop back up to k columns with
    `rollback: k`, continue with generate (which checks the cropped cache's tokens): equal to the recompute."""
    model, _ = models(s["family"], torch.float64)
    config = {"recurrent": {"rollback": s["k"], "state_dtype": torch.float64}}
    if any(layer.kind == "attention" and layer.type_name != "full" for layer in model.make_cache(1).layers):
        config["attention"] = {"type": "full"}  # sliding / chunked layers evict what a crop would need back
    g = torch.Generator().manual_seed(s["seed"])
    total = s["length"] + s["fed"] + s["new"]
    ids = torch.randint(3, 384, (s["batch"], total), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(s["pads"]):
        mask[row, :pad] = 0
    cache = model.make_cache(s["batch"], config)
    model(ids[:, : s["length"]], cache, mask[:, : s["length"]])
    fed = range(s["length"], s["length"] + s["fed"])
    for start, end in [(t, t + 1) for t in fed] if s["steps"] else [(fed.start, fed.stop)]:
        model(ids[:, start:end], cache)
    n = max(cache.columns - s["back"], max(s["pads"]))  # keep a real token in every row
    cache.crop(n)
    keep = n + s["new"]
    out = hc.generate(model, ids[:, :keep], attention_mask=mask[:, :keep], max_new_tokens=2, cache=cache)
    oracle = hc.generate(
        model, ids[:, :keep], attention_mask=mask[:, :keep], max_new_tokens=2, cache_config=config, use_cache=False
    )
    assert torch.equal(out.sequences, oracle.sequences)
    assert (out.logits - oracle.logits).abs().max().item() < 1e-9

"""Score-based compression methods against independent transcriptions of kvpress's scoring (batch 1, unpadded, the
prompt as one block: kvpress's setting), written here from the presses' equations with none of our code; then the
same rows inside a left-padded batch, continuous schedule, and the hybrid families."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridcache.cache import Cache, CacheConfigError, NativeLayer
from hybridcache.cache.methods.scored_eviction import QueryInputs

HKV, GROUP, D = 2, 2, 8
HQ = HKV * GROUP


def feed(cache, q, k, v, mask=None, queries=None):
    """One block through layer 0 with naive grouped attention; hands the weights (and queries) over."""
    t = k.shape[2]
    with cache.block(mask, t):
        view = cache[0].update(k, v)
        keys = view.keys.repeat_interleave(GROUP, 1)
        vis = view.mask if view.mask.dim() == 4 else view.mask[:, None]
        vis = vis.repeat_interleave(GROUP, 1) if vis.shape[1] > 1 else vis
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
        if getattr(cache[0], "wants_queries", False):
            cache[0].observe_attention(probs, queries)
        elif cache[0].wants_attention_weights:
            cache[0].observe_attention(probs)
    return cache


def build(params, batch=1):
    return Cache.build(
        [NativeLayer("full", {"num_kv_heads": HKV, "head_dim": D, "dtype": torch.float64})],
        batch,
        {"attention": params},
    )


def data(t, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, t, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, HKV, t, D, generator=g, dtype=torch.float64) * (
        1 + torch.rand(1, HKV, t, 1, generator=g, dtype=torch.float64)
    )
    v = torch.randn(1, HKV, t, D, generator=g, dtype=torch.float64)
    return q, k, v


def causal_weights(q, k):
    """[1, Hq, T, T] softmax(q k^T / sqrt(d)) under the causal mask (GQA by repeating keys)."""
    t = k.shape[2]
    s = q @ k.repeat_interleave(GROUP, 1).transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1)


def kept_by(scores, n_kept):
    """kvpress ScorerPress.compress: topk per head -> sorted kept positions [Hkv, n_kept]."""
    return scores.topk(n_kept, dim=-1).indices.sort(-1).values[0]


def reference(name, q, k, v, ratio, **kw):
    t = k.shape[2]
    n_kept = max(1, int(t * (1 - ratio)))
    w = causal_weights(q, k)
    if name == "knorm":
        scores = -k.norm(dim=-1)
    elif name == "streaming_llm":
        scores = torch.ones(1, HKV, t, dtype=torch.float64)
        scores[:, :, kw["n_sink"] : kw["n_sink"] + t - n_kept] = 0
    elif name in ("snapkv", "pyramidkv"):
        win, ker = kw["window_size"], kw["kernel_size"]
        s = w[..., -win:, :-win].mean(-2)
        s = F.avg_pool1d(s, kernel_size=ker, padding=ker // 2, stride=1)
        s = s.view(1, HKV, GROUP, t - win).mean(2)
        scores = F.pad(s, (0, win), value=s.max().item() + 1)
    elif name == "tova":
        s = w[..., -1:, :-1].mean(1)
        scores = F.pad(s.repeat(1, HKV, 1), (0, 1), value=s.max().item() + 1)
    elif name == "observed_attention":
        s = w.sum(2) / torch.arange(t, 0, -1, dtype=torch.float64)
        scores = s.view(1, HKV, GROUP, t).mean(2)
    elif name == "expected_attention":
        sink = kw["n_sink"]
        h = q[:, :, sink:]  # no rotary in this test: the queries are their own pre-rotary form
        mu = h.mean(2, keepdim=True)
        c = h - mu
        cov = torch.einsum("bnsi,bnsj->bnij", c, c) / h.shape[2]
        keys = k[:, :, sink:].repeat_interleave(GROUP, 1).transpose(2, 3)
        s = torch.matmul(mu, keys).squeeze(2) / math.sqrt(D)
        s = s + torch.einsum("bhin,bhij,bhjn->bhn", keys, cov, keys) / D / 2
        s = F.softmax(s, dim=-1).view(1, HKV, GROUP, -1).mean(2) * v[:, :, sink:].norm(dim=-1)
        scores = F.pad(s, (sink, 0), value=s.max().item() + 1)
    else:
        raise AssertionError(name)
    return kept_by(scores, n_kept)


CASES = [
    ("knorm", {}),
    ("streaming_llm", {"n_sink": 3}),
    ("snapkv", {"window_size": 6, "kernel_size": 3}),
    ("tova", {"schedule": "prefill"}),
    ("observed_attention", {}),
    ("expected_attention", {"n_sink": 2}),
]


@pytest.mark.parametrize("name,kw", CASES)
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
def test_prefill_keeps_what_kvpress_would(name, kw, ratio):
    t = 40
    q, k, v = data(t, seed=int(ratio * 10) + len(name))
    cache = feed(
        build({"type": name, "compression_ratio": ratio, "schedule": "prefill", **kw}),
        q,
        k,
        v,
        queries=QueryInputs(q, None, 1 / math.sqrt(D)),
    )
    want = reference(name, q, k, v, ratio, **{x: y for x, y in kw.items() if x != "schedule"})
    pos = cache[0].key_positions()
    got = pos[0] if pos.dim() == 3 else pos[0][None].expand(HKV, -1)
    assert torch.equal(got, want)


def test_pyramidkv_budgets_per_layer_match_kvpress_formula():
    """get_layer_budget, transcribed: layer 0 keeps the most, the last the fewest, their mean the uniform budget."""
    from hybridcache.cache.methods.presses import PyramidKVSpec

    def budget(q_len, r, w, beta, idx, layers):
        cap = w + q_len * (1 - r)
        lo = (cap - w) / beta
        hi = (cap - w) * 2 - lo
        if hi >= q_len - w:
            hi = q_len - w
            lo = (cap - w) * 2 - hi
        if not (q_len >= hi >= lo >= w):
            return max(1, round(q_len * (1 - r)))
        return round(hi - idx * (hi - lo) / (layers - 1))

    for q_len, r in ((400, 0.5), (400, 0.8), (1000, 0.7), (100, 0.9)):
        for idx in range(18):
            spec = PyramidKVSpec(num_kv_heads=1, head_dim=8, compression_ratio=r, layer_index=idx, num_layers=18)
            assert spec.layer_budget(q_len) == budget(q_len, r, 64, 20, idx, 18)
    spec = PyramidKVSpec(num_kv_heads=1, head_dim=8, compression_ratio=0.5, layer_index=0, num_layers=18)
    assert (
        spec.layer_budget(400)
        > 200
        > PyramidKVSpec(num_kv_heads=1, head_dim=8, compression_ratio=0.5, layer_index=17, num_layers=18).layer_budget(
            400
        )
    )


@pytest.mark.parametrize("name,kw", CASES)
def test_a_padded_row_keeps_what_it_keeps_alone(name, kw):
    t, pad = 30, 7
    q, k, v = data(t, seed=5)
    alone = feed(
        build({"type": name, "compression_ratio": 0.5, "schedule": "prefill", **kw}),
        q,
        k,
        v,
        queries=QueryInputs(q, None, 1 / math.sqrt(D)),
    )
    other = data(t + pad, seed=6)
    qb, kb, vb = (
        torch.cat([torch.cat([x.new_zeros(*x.shape[:2], pad, D), x], 2), y]) for x, y in zip((q, k, v), other)
    )
    mask = torch.ones(2, t + pad, dtype=torch.bool)
    mask[0, :pad] = False
    batch = feed(
        build({"type": name, "compression_ratio": 0.5, "schedule": "prefill", **kw}, batch=2),
        qb,
        kb,
        vb,
        mask,
        queries=QueryInputs(qb, None, 1 / math.sqrt(D)),
    )
    mine, together = alone[0].key_positions()[0], batch[0].key_positions()[0]
    together = together[..., (together >= 0).all(0) if together.dim() == 2 else together >= 0]
    assert torch.equal(mine, together)


def test_prefill_compresses_once_then_keeps_every_later_token():
    q, k, v = data(20, seed=1)
    cache = feed(build({"type": "knorm", "compression_ratio": 0.5}), q, k, v)
    assert cache[0].key_positions().shape == (1, HKV, 10) and cache[0].compressed
    for i in range(3):
        q1, k1, v1 = data(1, seed=10 + i)
        feed(cache, q1, k1, v1)
    pos = cache[0].key_positions()[0]
    assert pos.shape == (HKV, 13) and torch.equal(pos[:, -3:], torch.tensor([[20, 21, 22]] * HKV))


def test_continuous_budget_and_h2o_accumulation_against_a_naive_run():
    """H2O continuous: the kept set after each decode step is the top by attention accumulated over every query so
    far (averaged over the group) among non-recent tokens, plus the recent window; recomputed naively here."""
    budget, recent = 8, 3
    g = torch.Generator().manual_seed(0)
    t = 24
    q = torch.randn(1, HQ, t, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, HKV, t, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, HKV, t, D, generator=g, dtype=torch.float64)
    cache = build({"type": "h2o", "budget": budget, "recent": recent})
    kept = [list(range(0)) for _ in range(HKV)]
    acc = [dict() for _ in range(HKV)]
    for step in range(t):
        feed(cache, q[:, :, step : step + 1], k[:, :, step : step + 1], v[:, :, step : step + 1])
        for h in range(HKV):
            kept[h].append(step)
            acc[h][step] = 0.0
            for j in range(GROUP):
                qh = q[0, h * GROUP + j, step]
                s = torch.stack([qh @ k[0, h, p] for p in kept[h]]) / math.sqrt(D)
                for p, w in zip(kept[h], torch.softmax(s, 0).tolist()):
                    acc[h][p] += w / GROUP
            if len(kept[h]) > budget:
                recent_set = [p for p in kept[h] if p > step - recent]
                heavy = sorted((p for p in kept[h] if p not in recent_set), key=lambda p: (-acc[h][p], -p))
                kept[h] = sorted(heavy[: budget - len(recent_set)] + recent_set)
        got = cache[0].key_positions()[0]
        assert got.tolist() == kept, f"step {step}"


def test_bad_parameters_are_named():
    for params, words in (
        ({"type": "snapkv"}, "exactly one of"),
        ({"type": "snapkv", "compression_ratio": 1.0}, "[0, 1)"),
        ({"type": "h2o", "compression_ratio": 0.5}, "continuous"),
        ({"type": "knorm", "compression_ratio": 0.5, "schedule": "sometimes"}, "schedule"),
        ({"type": "snapkv", "compression_ratio": 0.5, "kernel_size": 4}, "odd"),
        ({"type": "knorm", "compression_ratio": 0.5, "storage": "int8", "residual": 4}, "per kv head"),
        ({"type": "tova", "budget": 4, "max_length": 64}, "dynamic storage"),
    ):
        with pytest.raises(CacheConfigError, match=words.replace("[", r"\[").replace(")", r"\)")):
            build(params)


# -- kvpress's decoding-time presses: DecodingPress / PrefillDecodingPress ------------------------------------------


def kvpress_decoding_run(name, q, k, prompt, ratio, budget, interval, n_sink=2):
    """kvpress 0.5.5's DecodingPress (PrefillDecodingPress when `ratio`) around `name`'s scorer, transcribed with
    none of our code: a plain list of held positions per kv head; the prompt compressed by `ratio` (or kept); then
    per one-token step: append, count, and at the interval-th step keep the top `n_kept` by the scorer, n_kept from
    the bisected ratio (kvpress's _find_target_compression_ratio then compute_n_kept). Positions, not slots, order
    StreamingLLM's window (kvpress's own slot order drifts after one compression: docs/presses_decoding.md).
    Returns the held positions [Hkv, n] (ascending) after every step."""

    def n_kept_of(k_len):
        if k_len <= budget:
            return k_len
        r, lo, hi = 1.0 - budget / k_len, 0.0, 1.0
        for _ in range(20):
            n = int(k_len * (1 - r))
            if n == budget:
                break
            lo, r, hi = (r, (r + hi) / 2, hi) if n > budget else (lo, (lo + r) / 2, r)
        return max(1, int(k_len * (1 - r)))

    def scores(held, step):  # [Hkv, len(held)] for the keys at `held` positions; step: the current token
        keys = torch.stack([k[0, h, held[h]] for h in range(HKV)])  # [Hkv, n, D]
        if name == "knorm":
            return -keys.norm(dim=-1)
        if name == "tova":  # the current query over every held key, softmax, mean over all query heads
            att = torch.stack(
                [torch.softmax(q[0, j, step] @ keys[j // GROUP].T / math.sqrt(D), -1) for j in range(HQ)]
            ).mean(0)
            out = att.expand(HKV, -1).clone()
            out[:, -1] = out.max() + 1  # the last slot (the current token) kept
            return out
        pos = torch.tensor(held, dtype=torch.float64)  # streaming_llm: the sinks, then the most recent
        return torch.where(pos < n_sink, math.inf, pos)

    held = [list(range(prompt)) for _ in range(HKV)]
    if ratio is not None:  # the prefill press: the prompt's own scores (reference() above: kvpress's)
        kept = reference(name, q[:, :, :prompt], k[:, :, :prompt], k[:, :, :prompt], ratio, n_sink=n_sink)
        held = [kept[h].tolist() for h in range(HKV)]
    history, count = [], 0
    for step in range(prompt, k.shape[2]):
        held = [h + [step] for h in held]
        count += 1
        if count >= interval:
            s, n = scores(held, step), n_kept_of(len(held[0]))
            held = [sorted(held[h][i] for i in s[h].topk(n).indices.tolist()) for h in range(HKV)]
            count = 0
        history.append(torch.tensor(held))
    return history


DECODING_CASES = [("knorm", {}), ("tova", {}), ("streaming_llm", {"n_sink": 2})]


@pytest.mark.parametrize("name,kw", DECODING_CASES)
@pytest.mark.parametrize("schedule,ratio", [("decoding", None), ("prefill_decoding", 0.5)])
@pytest.mark.parametrize("budget,interval", [(12, 4), (9, 1), (20, 7)])
def test_decoding_schedules_keep_what_kvpress_decoding_press_would(name, kw, schedule, ratio, budget, interval):
    prompt, steps = 16, 30
    q, k, v = data(prompt + steps, seed=budget * 10 + interval + len(name))
    params = {"type": name, "schedule": schedule, "budget": budget, "compression_interval": interval, **kw}
    if ratio is not None:
        params["compression_ratio"] = ratio
    cache = build(params)
    feed(cache, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
    want = kvpress_decoding_run(name, q, k, prompt, ratio, budget, interval, **({"n_sink": 2} if kw else {}))
    for step in range(steps):
        t = prompt + step
        feed(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        pos = cache[0].key_positions()[0]
        got = pos if pos.dim() == 2 else pos[None].expand(HKV, -1)
        assert torch.equal(got, want[step]), f"step {step}: {got.tolist()} != {want[step].tolist()}"


def test_decoding_leaves_the_prompt_whole_and_counts_a_long_block_as_due():
    """kvpress: no compression in the prefill forward, even one longer than target_size; a later forward of at
    least target_size tokens compresses at once (q_len >= target_size), whatever the step count."""
    q, k, v = data(40, seed=3)
    cache = build({"type": "knorm", "schedule": "decoding", "budget": 8, "compression_interval": 100})
    feed(cache, q[:, :, :20], k[:, :, :20], v[:, :, :20])
    assert cache[0].key_positions().shape[-1] == 20 and cache[0].compressed
    feed(cache, q[:, :, 20:27], k[:, :, 20:27], v[:, :, 20:27])  # 7 < budget tokens: counted, kept
    assert cache[0].key_positions().shape[-1] == 27
    feed(cache, q[:, :, 27:35], k[:, :, 27:35], v[:, :, 27:35])  # 8 = budget tokens: compressed now
    want = (-k[0, :, :35].norm(dim=-1)).topk(8).indices.sort(-1).values
    assert torch.equal(cache[0].key_positions()[0], want)


def test_decoding_rows_of_a_padded_batch_keep_what_they_keep_alone():
    prompt, steps, pad = 14, 12, 5
    params = {"type": "tova", "schedule": "decoding", "budget": 10, "compression_interval": 3}
    q, k, v = data(prompt + steps, seed=11)
    alone = build(params)
    feed(alone, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
    other = data(prompt + pad + steps, seed=12)
    qb, kb, vb = (
        torch.cat([torch.cat([x.new_zeros(*x.shape[:2], pad, D), x], 2), y]) for x, y in zip((q, k, v), other)
    )
    mask = torch.ones(2, prompt + pad, dtype=torch.bool)
    mask[0, :pad] = False
    batch = build(params, batch=2)
    feed(batch, qb[:, :, : prompt + pad], kb[:, :, : prompt + pad], vb[:, :, : prompt + pad], mask)
    for step in range(steps):
        t = prompt + step
        feed(alone, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        feed(batch, qb[:, :, t + pad : t + pad + 1], kb[:, :, t + pad : t + pad + 1], vb[:, :, t + pad : t + pad + 1])
        mine, together = alone[0].key_positions()[0], batch[0].key_positions()[0]
        assert torch.equal(mine, together[together >= 0]), f"step {step}"


@pytest.mark.parametrize(
    "params",
    [
        {"type": "knorm", "schedule": "decoding", "budget": 5, "compression_interval": 2, "compression_ratio": None},
        {
            "type": "tova",
            "schedule": "prefill_decoding",
            "compression_ratio": 0.4,
            "budget": 6,
            "compression_interval": 3,
        },
        {"type": "streaming_llm", "schedule": "decoding", "budget": 6, "compression_interval": 1, "n_sink": 2},
    ],
)
def test_decoding_schedules_pass_the_conformance_kit(params):
    from hybridcache.testing import check_cache_type

    name = params.pop("type")
    counts = check_cache_type(name, params=params, cases=8)
    assert counts["split == one-shot"] == 8 and counts["snapshot / restore"] > 0 and counts["atomic failures"] > 0


def test_tokens_held_is_what_a_decoding_layer_holds():
    """The planner's count (press_schedule.tokens_held) against a layer fed that scenario: the most it held
    between two blocks, and what it holds at the end (exact under full attention, a bound under a window)."""
    from hybridcache.cache.methods.press_schedule import tokens_held

    for params in (
        {"type": "knorm", "schedule": "decoding", "budget": 10, "compression_interval": 4},
        {
            "type": "knorm",
            "schedule": "prefill_decoding",
            "compression_ratio": 0.5,
            "budget": 6,
            "compression_interval": 5,
        },
        {"type": "knorm", "schedule": "decoding", "budget": 7, "compression_interval": 3, "window": 9},
        {"type": "knorm", "compression_ratio": 0.5},
    ):
        prompt, total = 15, 40
        q, k, v = data(total, seed=2)
        cache = build(params)
        feed(cache, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
        most = held = (cache[0].key_positions()[0] >= 0).sum(-1).max().item()
        for t in range(prompt, total):
            feed(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            held = (cache[0].key_positions()[0] >= 0).sum(-1).max().item()
            most = max(most, held)
            assert cache[0].nbytes() <= cache[0].min_nbytes(), params
        spec = cache[0].spec
        if spec.window is None:
            assert tokens_held(spec, prompt, total) == held, params
            assert tokens_held(spec, prompt, total, peak=True) == most, params
        else:  # kept tokens leave a window as it moves on: the count is a bound there
            assert tokens_held(spec, prompt, total) >= held and tokens_held(spec, prompt, total, peak=True) >= most


def test_decoding_schedules_refuse_bad_parameters_by_name():
    for params, words in (
        ({"type": "snapkv", "schedule": "decoding", "budget": 8}, "offered for knorm, tova and streaming_llm only"),
        ({"type": "h2o", "schedule": "decoding", "budget": 8}, "offered for knorm, tova and streaming_llm only"),
        ({"type": "knorm", "schedule": "decoding"}, "give budget"),
        ({"type": "knorm", "schedule": "decoding", "budget": 8, "compression_ratio": 0.5}, "prefill_decoding"),
        ({"type": "knorm", "schedule": "prefill_decoding", "budget": 8}, "give both"),
        ({"type": "knorm", "schedule": "decoding", "budget": 8, "compression_interval": 0}, "positive integer"),
        ({"type": "knorm", "schedule": "decoding", "budget": 8, "compression_interval": True}, "positive integer"),
        ({"type": "knorm", "compression_ratio": 0.5, "compression_interval": 4}, "applies to schedules decoding"),
        ({"type": "tova", "budget": 4, "compression_interval": 4}, "not 'continuous'"),
    ):
        with pytest.raises(CacheConfigError, match=words):
            build(params)


# -- the eviction schedule's old name ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        {"attention": {"type": "knorm", "compression_ratio": 0.5, "mode": "prefill"}},  # a typed entry
        {"attention": {"mode": "prefill"}},  # a kind-wide one
        {"layers": {0: {"type": "tova", "budget": 4, "mode": "continuous"}}},  # one layer's
    ],
)
def test_the_old_name_mode_is_refused_naming_schedule(config):
    """`mode:` was renamed to `schedule:` ("mode" is only the logger's): a config still giving it is told so."""
    native = [NativeLayer("full", {"num_kv_heads": 2, "head_dim": 4})]
    with pytest.raises(CacheConfigError, match=r"\.mode was renamed to 'schedule'"):
        Cache.build(native, 1, config)


def test_a_file_saved_with_mode_loads_as_schedule(tmp_path):
    """A cache saved before the rename (its press spec recorded as `mode`) loads and continues as the saved one."""
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    import hybridcache as hc
    from hybridcache.cache.io.persistence import _metadata, header_sha256
    from hybridcache.checkpoints.tiny import tiny_checkpoint

    model = hc.from_pretrained(tiny_checkpoint("gemma3"), dtype=torch.float32)
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(1, {"attention": {"type": "tova", "budget": 6, "schedule": "continuous"}})
    model(ids[:, :20], cache=cache)
    cache.save(tmp_path / "new", model=model)
    data = (tmp_path / "new").read_bytes()
    header = json.loads(_metadata(data)["hybridcache"])
    for layer in header["layers"]:
        layer["spec"]["mode"] = layer["spec"].pop("schedule")  # as saved before 2026-11-29
    header["header_sha256"] = header_sha256(header)
    (tmp_path / "old").write_bytes(st_save(st_load(data), metadata={"hybridcache": json.dumps(header)}))
    loaded = Cache.load(tmp_path / "old", model=model)
    assert [layer.spec for layer in loaded.entries] == [layer.spec for layer in cache.entries]
    a, b = model(ids[:, 20:], cache=cache), model(ids[:, 20:], cache=loaded)
    assert torch.equal(getattr(a, "logits", a), getattr(b, "logits", b))

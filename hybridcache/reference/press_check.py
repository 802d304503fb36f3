"""Our score-based methods against kvpress on the same model, prompt and ratio: which positions each layer and kv
head kept, and the teacher-forced NLL of a continuation after the compressed prefill (kvpress's protocol: the
prompt in one forward, compressed at its end; the continuation in one forward at positions after the prompt).

    check = check_press(model, checkpoint_dir, context_ids, continuation_ids, "snapkv", 0.5)
    check.kept_agreement    # |ours ∩ kvpress| / |kvpress| over every compressed layer and head
    check.ours_nll, check.reference_nll

The decoding-time presses (`check_decoding_press`): ours in `schedule: decoding` / `prefill_decoding` against kvpress's
DecodingPress / PrefillDecodingPress, the continuation fed one token per block / forward (kvpress compresses while
decoding): the positions every layer holds after each compression and at the end, the NLL, greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybridcache.reference.kvpress_decoding import KvpressDecodingResult, run_decoding_press
from hybridcache.reference.kvpress_runner import KvpressResult, run_press

KVPRESS_CLASS = {
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
    "pyramidkv": "PyramidKVPress",
}
# kvpress 0.5.5 on transformers 5.2 scores pyramidkv's continuation only token by token (its layers' cache lengths
# differ and 5.2 sizes every layer's mask from layer 0); the NLL is the same quantity
FEED = {"pyramidkv": "per_token"}


@dataclass
class PressCheck:
    method: str
    compression_ratio: float
    reference: str  # e.g. "kvpress 0.5.5 SnapKVPress"
    ours_nll: float
    reference_nll: float | None
    max_token_nll_diff: float | None  # max over continuation tokens of |ours - kvpress|
    kept_agreement: float  # mean over compressed layers and kv heads of |ours ∩ kvpress| / |kvpress|
    layers_compared: int
    kept_tokens: int  # per head, summed over the compared layers (kvpress's count)
    reference_error: str | None = None
    reference_seconds: float = 0.0
    per_layer: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def continuation_nll(model, context: torch.Tensor, continuation: torch.Tensor, cache_config: dict) -> tuple:
    """Ours: the prompt as one block into a fresh cache, then the continuation as one block. Returns (NLL per
    continuation token [N], the cache)."""
    cache = model.make_cache(1, cache_config)
    with torch.no_grad():
        first = model(context, cache=cache)[:, -1:]  # predicts continuation token 0
        rest = model(continuation, cache=cache)[:, :-1]
    logits = torch.cat([first, rest], 1).float().log_softmax(-1)[0]  # [N, V]
    return -logits.gather(-1, continuation[0, :, None])[:, 0], cache


def kept_positions(cache) -> dict[int, torch.Tensor]:
    """Decoder layer -> [Hkv, S] positions its attention cache layer holds (batch row 0; -1 empty)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if layer.kind == "attention":
            pos = layer.key_positions()[0]
            out[i] = pos if pos.dim() == 2 else pos[None].expand(layer.spec.num_kv_heads, -1)
    return out


def agreement(ours: dict[int, torch.Tensor], theirs: dict[int, torch.Tensor]) -> dict[int, float]:
    """Per layer: the mean over kv heads of the share of kvpress's kept positions that we kept too."""
    per_layer = {}
    for layer, ref in theirs.items():
        mine = ours[layer]
        shares = [
            len(set(mine[h][mine[h] >= 0].tolist()) & set(ref[h].tolist())) / max(1, ref.shape[1])
            for h in range(ref.shape[0])
        ]
        per_layer[layer] = sum(shares) / len(shares)
    return per_layer


def check_press(
    model,
    checkpoint_dir,
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    method: str,
    compression_ratio: float,
    reference: KvpressResult | None = None,
    **press_kwargs: Any,
) -> PressCheck:
    """Run `method` at `compression_ratio` on every attention layer (schedule: prefill, kvpress's semantics) in our
    cache and in kvpress (unless `reference` is given), and compare."""
    context = torch.tensor([list(context_ids)])
    continuation = torch.tensor([list(continuation_ids)])
    config = {
        "attention": {"type": method, "compression_ratio": compression_ratio, "schedule": "prefill", **press_kwargs}
    }
    nll, cache = continuation_nll(model, context, continuation, config)
    if reference is None:
        reference = run_press(
            checkpoint_dir,
            context_ids,
            continuation_ids,
            press=method,
            compression_ratio=compression_ratio,
            feed=FEED.get(method, "one_forward"),
            **press_kwargs,
        )
    version = reference.meta.get("kvpress_version", "0.5.5")
    theirs = {i: k for i, k in reference.kept.items() if k.shape[1] < len(context_ids)}
    per_layer = agreement(kept_positions(cache), theirs)
    ref_nll = reference.nll
    return PressCheck(
        method=method,
        compression_ratio=compression_ratio,
        reference=f"kvpress {version} {KVPRESS_CLASS[method]}",
        ours_nll=float(nll.mean()),
        reference_nll=None if ref_nll is None else float(ref_nll.mean()),
        max_token_nll_diff=None if ref_nll is None else float((nll - ref_nll.to(nll.dtype)).abs().max()),
        kept_agreement=sum(per_layer.values()) / max(1, len(per_layer)),
        layers_compared=len(per_layer),
        kept_tokens=sum(int(k.shape[1]) for k in theirs.values()),
        reference_error=reference.error,
        reference_seconds=reference.wall_s,
        per_layer=per_layer,
    )


# -- kvpress's decoding-time presses -------------------------------------------------------------------------------
@dataclass
class DecodingCheck:
    """Ours (`schedule: decoding` / `prefill_decoding`) against kvpress's DecodingPress / PrefillDecodingPress."""

    method: str
    schedule: str
    budget: int
    compression_interval: int
    compression_ratio: float | None
    reference: str  # e.g. "kvpress 0.5.5 DecodingPress(TOVAPress)"
    ours_nll: float
    reference_nll: float | None
    max_token_nll_diff: float | None
    kept_agreement: float  # mean over every compression, layer and kv head of |ours ∩ kvpress| / |kvpress|
    compressions: int  # kvpress's compression events compared (layers x steps)
    same_steps: bool  # ours compressed at exactly kvpress's steps, on every layer
    held_agreement: float  # the same share for what every layer holds after the continuation
    differing: int  # positions (over compressions, layers, heads) kept by one side only, counted once per pair
    not_ties: int  # pairs at the first differing compression that our own scores do not call a tie (the causes;
    # later differences follow from a different kept set: the next layers' keys change)
    first_differing_step: int | None  # the first compression where the kept sets differ
    max_token_nll_diff_before: float | None  # |ΔNLL| over the tokens predicted before that difference acts
    greedy_ours: list[int] = field(default_factory=list)
    greedy_reference: list[int] = field(default_factory=list)
    reference_error: str | None = None
    reference_seconds: float = 0.0
    per_step: dict[int, float] = field(default_factory=dict)  # continuation step -> agreement over its layers

    @property
    def greedy_same(self) -> int:
        """Leading greedy tokens both pick alike."""
        same = 0
        for a, b in zip(self.greedy_ours, self.greedy_reference):
            if a != b:
                break
            same += 1
        return same

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "greedy_same": self.greedy_same}


def check_decoding_case(method: Any, schedule: Any, budget: Any, interval: Any, ratio: Any) -> None:
    """A ValueError naming what is wrong with one decoding-time case, before any work."""
    from hybridcache.reference.kvpress_decoding import DECODING_PRESSES, DECODING_SCHEDULES

    if method not in DECODING_PRESSES:
        raise ValueError(f"method {method!r} has no decoding-time check (known: {', '.join(DECODING_PRESSES)})")
    if schedule not in DECODING_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(DECODING_SCHEDULES)}, got {schedule!r}")
    for name, value in (("budget", budget), ("compression_interval", interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if (schedule == "prefill_decoding") != (ratio is not None):
        raise ValueError(f"compression_ratio (the prompt's) goes with schedule prefill_decoding only; got {ratio!r}")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1):
        raise ValueError(f"compression_ratio must be a number in [0, 1), got {ratio!r}")


def decoding_config(
    method: str, schedule: str, budget: int, interval: int, ratio: float | None, **press_kwargs
) -> dict:
    params = {"type": method, "schedule": schedule, "budget": budget, "compression_interval": interval, **press_kwargs}
    if ratio is not None:
        params["compression_ratio"] = ratio
    return {"attention": params}


def decoding_run(model, context: torch.Tensor, continuation: torch.Tensor, cache_config: dict) -> tuple:
    """Ours: the prompt as one block, then the continuation one token per block (teacher-forced). Returns (NLL per
    continuation token [N], {step: {layer: positions}} after every block whose compression evicted something (step
    -1: the prompt), {step: {layer: (scores [Hs, S], positions [Hs, S])}} that compression ranked, the positions
    per layer at the end)."""
    cache = model.make_cache(1, cache_config)
    layers = {i: layer for i, layer in enumerate(cache.layers) if layer.kind == "attention"}
    ranked: dict[int, tuple] = {}
    for i, layer in layers.items():
        layer.score = _recording(layer.score, ranked, i)  # an instance attribute: _evict calls it
    first = next(iter(layers.values()))
    events: dict[int, dict[int, torch.Tensor]] = {}
    scores: dict[int, dict[int, tuple]] = {}
    with torch.no_grad():
        logits = [model(context, cache=cache)[:, -1]]  # [1, V] predicts continuation token 0
        held = _held(first)
        if first.spec.schedule == "prefill_decoding" and held < context.shape[1]:
            events[-1], scores[-1] = kept_positions(cache), dict(ranked)
        for t in range(continuation.shape[1]):
            ranked.clear()
            logits.append(model(continuation[:, t : t + 1], cache=cache)[:, -1])
            before, held = held, _held(first)
            if int(first.decode_steps[0]) == 0 and held < before + 1:  # a due compression that evicted
                events[t], scores[t] = kept_positions(cache), dict(ranked)
    logp = torch.stack(logits[:-1], 1).float().log_softmax(-1)[0]  # [N, V]
    return -logp.gather(-1, continuation[0, :, None])[:, 0], events, scores, kept_positions(cache)


def _recording(score, ranked: dict, index: int):
    def recorded(ctx):
        out = score(ctx)  # [B, Hs, S]
        ranked[index] = (out[0].double(), ctx.slot_positions()[0].expand(out.shape[1], -1))
        return out

    return recorded


def _held(layer) -> int:
    """Tokens row 0 of a scored layer holds (the most of any kv head)."""
    pos = layer.key_positions()[0]
    return int((pos >= 0).sum(-1).max())


def greedy_run(model, context: torch.Tensor, n: int, cache_config: dict) -> list[int]:
    """The `n` tokens greedy decoding picks after `context`, the prompt as one block and then one token per block."""
    cache, out = model.make_cache(1, cache_config), []
    with torch.no_grad():
        token = model(context, cache=cache)[:, -1].argmax(-1)  # [1]
        for t in range(n):
            out.append(int(token))
            if t + 1 < n:
                token = model(token[:, None], cache=cache)[:, -1].argmax(-1)
    return out


def check_decoding_press(
    model,
    checkpoint_dir,
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    method: str,
    schedule: str,
    budget: int,
    compression_interval: int,
    compression_ratio: float | None = None,
    greedy: int = 0,
    reference: KvpressDecodingResult | None = None,
    **press_kwargs: Any,
) -> DecodingCheck:
    """Run `method` in `schedule` on every attention layer in our cache and in kvpress (unless `reference` is given):
    the positions every layer holds after each compression and at the end, the teacher-forced NLL of the
    continuation fed token by token, and `greedy` greedily decoded tokens."""
    context, continuation = torch.tensor([list(context_ids)]), torch.tensor([list(continuation_ids)])
    config = decoding_config(method, schedule, budget, compression_interval, compression_ratio, **press_kwargs)
    nll, ours_events, ours_scores, ours_held = decoding_run(model, context, continuation, config)
    greedy_ours = greedy_run(model, context, greedy, config) if greedy else []
    if reference is None:
        reference = run_decoding_press(
            checkpoint_dir,
            context_ids,
            continuation_ids,
            method,
            budget,
            compression_interval,
            schedule,
            compression_ratio,
            greedy=greedy,
            **press_kwargs,
        )
    same_steps = all([s for s, _ in events] == sorted(ours_events) for events in reference.events.values())
    shares: dict[int, list[float]] = {}
    differing = 0
    first_differing = None
    causes: dict[int, int] = {}  # step -> pairs there that our scores do not call a tie
    for layer, events in reference.events.items():
        for step, theirs in events:
            mine = ours_events.get(step, {}).get(layer)
            if mine is None:
                shares.setdefault(step, []).extend([0.0] * theirs.shape[0])
                differing, first_differing = differing + theirs.numel(), _earliest(first_differing, step)
                causes[step] = causes.get(step, 0) + theirs.numel()
                continue
            shares.setdefault(step, []).extend(_head_shares(mine, theirs))
            pairs = _differing_pairs(mine, theirs)
            if pairs:
                differing, first_differing = differing + len(pairs), _earliest(first_differing, step)
                broken = sum(not _tie(ours_scores[step][layer], h, a, b) for h, a, b in pairs)
                causes[step] = causes.get(step, 0) + broken
    not_ties = 0 if first_differing is None else causes[first_differing]  # later ones follow from the first
    per_step = {s: sum(v) / len(v) for s, v in sorted(shares.items())}
    flat = [x for v in shares.values() for x in v]
    held = [x for layer, theirs in reference.held.items() for x in _head_shares(ours_held[layer], theirs)]
    version = reference.meta.get("kvpress_version", "0.5.5")
    wrapper = "PrefillDecodingPress" if schedule == "prefill_decoding" else "DecodingPress"
    ref_nll = reference.nll
    diff = None if ref_nll is None else (nll - ref_nll.to(nll.dtype)).abs()  # [N]
    # a compression at step s acts from the forward of step s + 1 on, which predicts token s + 2
    unaffected = len(nll) if first_differing is None else max(0, first_differing + 2)
    return DecodingCheck(
        method=method,
        schedule=schedule,
        budget=budget,
        compression_interval=compression_interval,
        compression_ratio=compression_ratio,
        reference=f"kvpress {version} {wrapper}({KVPRESS_CLASS[method]})",
        ours_nll=float(nll.mean()),
        reference_nll=None if ref_nll is None else float(ref_nll.mean()),
        max_token_nll_diff=None if diff is None else float(diff.max()),
        kept_agreement=sum(flat) / len(flat) if flat else 1.0,
        compressions=sum(len(e) for e in reference.events.values()),
        same_steps=same_steps,
        held_agreement=sum(held) / len(held) if held else 1.0,
        differing=differing,
        not_ties=not_ties,
        first_differing_step=first_differing,
        max_token_nll_diff_before=None if diff is None or not unaffected else float(diff[:unaffected].max()),
        greedy_ours=greedy_ours,
        greedy_reference=[] if reference.greedy is None else reference.greedy.tolist(),
        reference_error=reference.error,
        reference_seconds=reference.wall_s,
        per_step=per_step,
    )


TIE_RTOL = 1e-5  # float32 rounding between two implementations of the same score (kvpress's and ours)


def _earliest(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


def _differing_pairs(mine: torch.Tensor, theirs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(head, position only we kept, position only kvpress kept), paired in ascending order per head."""
    pairs = []
    for h in range(theirs.shape[0]):
        ours, ref = set(mine[h][mine[h] >= 0].tolist()), set(theirs[h].tolist())
        pairs += [(h, a, b) for a, b in zip(sorted(ours - ref), sorted(ref - ours))]
    return pairs


def _tie(ranked: tuple[torch.Tensor, torch.Tensor], head: int, a: int, b: int) -> bool:
    """Whether our own scores at that compression put positions a and b within TIE_RTOL of each other: an exact tie
    in exact arithmetic (knorm at layer 0: one token twice, rotary keeps the norm) that float rounding breaks."""
    scores, positions = ranked
    h = min(head, scores.shape[0] - 1)  # shared scores: one row for every head
    row, pos = scores[h], positions[h]
    sa, sb = row[pos == a], row[pos == b]
    if sa.numel() != 1 or sb.numel() != 1:
        return False
    sa, sb = float(sa), float(sb)
    return abs(sa - sb) <= TIE_RTOL * max(abs(sa), abs(sb))


def _head_shares(mine: torch.Tensor, theirs: torch.Tensor) -> list[float]:
    """Per kv head: the share of kvpress's positions that ours holds too."""
    return [
        len(set(mine[h][mine[h] >= 0].tolist()) & set(theirs[h].tolist())) / max(1, theirs.shape[1])
        for h in range(theirs.shape[0])
    ]

"""The measurement of experiment=drift: how a lossy recurrent state drifts when it is re-encoded after every token.

The reference cache (the app's cache, native by default) greedy-decodes `decode_tokens` tokens from each prompt
(or, `feed: text`, is fed the text that follows the prompt); in lockstep, every variant's cache is fed the same tokens
one per block (so its states are re-encoded after every token, as in decoding), and at each position p (the
distribution of token p after the prompt) we record, per row,
    kl    KL(reference || variant) of the next-token distributions (nats)
    top1  whether the variant's most likely token is the reference's (its greedy choice).
Lockstep keeps one step of logits per cache in memory whatever the vocabulary and length.

A variant is written `codec[+sr][+ef[:error_codec]]` (int8, int8+sr, int4+ef, int8+sr+ef:int4, ...): sr is
`rounding: stochastic`, ef `error_feedback: true` (docs/state_drift.md); the controls drop the states after every
block: ablate_ssm (`state_codec: zero`: SSM / LRU / delta-rule states) and ablate_state (conv states too).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CONTROLS = {"ablate_ssm": {"state_codec": "zero"}, "ablate_state": {"state_codec": "zero", "quantize_conv": True}}
REMEDY_PARTS = ("sr", "ef")


class VariantError(ValueError):
    """A variant name that does not parse (experiment.variants)."""


@dataclass(frozen=True)
class Variant:
    name: str
    recurrent: dict[str, Any]  # merged onto the reference's `recurrent:` entry
    codec: str  # the state codec (a control: its name)
    remedy: str  # "none", "sr", "ef", "sr+ef" (":rc" kept on ef), or "control"


def parse_variant(text: Any, seed: int) -> Variant:
    """`codec[+sr][+ef[:error_codec]]` -> its recurrent cache entry (VariantError for anything else)."""
    from hybridcache.cache.recurrent.codecs import available_state_codecs, get_state_codec

    if not isinstance(text, str) or not text:
        raise VariantError(f"experiment.variants: each variant is a string like int8+sr+ef, got {text!r}")
    if text in CONTROLS:
        return Variant(text, dict(CONTROLS[text]), text, "control")
    codec, *parts = text.split("+")
    lossy = [c for c in available_state_codecs() if get_state_codec(c).rounds]
    if codec not in lossy:
        raise VariantError(f"experiment.variants: '{text}' starts with '{codec}', not a lossy state codec ({lossy})")
    entry: dict[str, Any] = {"state_codec": codec}
    seen: list[str] = []
    for part in parts:
        key, _, residual = part.partition(":")
        if key not in REMEDY_PARTS or key in seen or (residual and key != "ef"):
            raise VariantError(
                f"experiment.variants: '{text}': '+{part}' is not one of +sr, +ef, +ef:<residual codec> (each once)"
            )
        seen.append(key)
        if key == "sr":
            entry.update(rounding="stochastic", rounding_seed=seed)
        else:
            entry["error_feedback"] = True
            if residual:
                entry["error_codec"] = residual  # checked by the cache config (a named CacheConfigError)
    remedy = "+".join(p for p in ("sr", "ef") if p in seen) or "none"
    if "error_codec" in entry:
        remedy += f":{entry['error_codec']}"
    return Variant(text, entry, codec, remedy)


def variant_config(base: Mapping[str, Any] | None, variant: Variant) -> dict[str, Any]:
    """The reference's cache config with the variant's recurrent entry on top."""
    config = copy.deepcopy(dict(base or {}))
    config["recurrent"] = {**dict(config.get("recurrent") or {}), **variant.recurrent}
    return config


@dataclass
class DriftRecord:
    """Per variant: kl [N, B] and top1 [N, B] (position, row); the decoded tokens [B, N]; seconds per cache."""

    tokens: torch.Tensor
    kl: dict[str, torch.Tensor] = field(default_factory=dict)
    top1: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def measure_drift(
    model: Any,
    prompts: torch.Tensor,
    decode_tokens: int,
    configs: Mapping[str, Mapping[str, Any]],
    reference: Mapping[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
    text: torch.Tensor | None = None,
) -> DriftRecord:
    """prompts [B, P]: the reference greedy-decodes `decode_tokens` tokens (or is fed `text` [B, >= N - 1], the
    tokens after the prompt); each config in `configs` is fed the same tokens one per block. Returns the per-position
    KL and top-1 agreement of each config against the reference, and the tokens fed."""
    batch, n = prompts.shape[0], decode_tokens
    prompts = prompts.to(model.device)
    names = ["reference", *configs]
    caches = {"reference": model.make_cache(batch, reference)}
    caches.update({name: model.make_cache(batch, cfg) for name, cfg in configs.items()})
    seconds = dict.fromkeys(names, 0.0)

    def step(name: str, ids: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = model(ids, caches[name])[:, -1].float()  # [B, V]
        seconds[name] += time.perf_counter() - start
        return out

    logits = {name: step(name, prompts) for name in names}
    record = DriftRecord(torch.empty(batch, n, dtype=torch.long))
    for name in configs:
        record.kl[name] = torch.empty(n, batch, dtype=torch.float64)
        record.top1[name] = torch.empty(n, batch, dtype=torch.bool)
    for p in range(n):
        ref = logits["reference"].log_softmax(-1)  # [B, V]
        best = ref.argmax(-1)  # [B] the reference's greedy choice
        token = best if text is None else text[:, p].to(best.device)
        record.tokens[:, p] = token.cpu()
        for name in configs:
            got = logits[name].log_softmax(-1)
            record.kl[name][p] = (ref.exp() * (ref - got)).sum(-1).clamp(min=0).double().cpu()
            record.top1[name][p] = (got.argmax(-1) == best).cpu()
        if p + 1 < n:
            logits = {name: step(name, token[:, None]) for name in names}
        if on_step is not None:
            on_step(p)
    record.seconds = seconds
    return record


def windows_of(windows: Sequence[Sequence[int]], n: int) -> list[tuple[int, int]]:
    """The [start, end) windows clipped to the n decoded positions (empty ones dropped)."""
    out = []
    for a, b in windows:
        a, b = max(0, int(a)), min(n, int(b))
        if a < b:
            out.append((a, b))
    return out


def summarize(record: DriftRecord, windows: Sequence[tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Per variant: mean KL and top-1 agreement (over rows and positions) in each window and over everything."""
    out = {}
    for name, kl in record.kl.items():
        top1 = record.top1[name].double()
        row: dict[str, Any] = {"kl_mean": float(kl.mean()), "top1_mean": float(top1.mean())}
        row["windows"] = [
            {"start": a, "end": b, "kl_mean": float(kl[a:b].mean()), "top1": float(top1[a:b].mean())}
            for a, b in windows
        ]
        out[name] = row
    return out


def smooth(values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Moving mean [N - w + 1] of a curve [N] over `width` positions, and the centre position of each window."""
    w = max(1, min(int(width), values.numel()))
    kernel = torch.full((1, 1, w), 1.0 / w, dtype=torch.float64)
    means = torch.nn.functional.conv1d(values.double()[None, None], kernel)[0, 0]
    return torch.arange(means.numel(), dtype=torch.float64) + (w - 1) / 2, means

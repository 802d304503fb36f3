"""Timings that say when they cannot be trusted: prefill and decode measured apart, medians over repeats, the spread
reported, and no rate or ratio from a timing that failed its checks.

Each system gives two phases, each timing itself with the clock it is handed: `prefill` (a 1-token generation) and
`decode` (the decode steps alone: a continuation of the prefill's cache, or the time from the first generated token to
the end). Nothing is derived by subtracting one noisy total from another, so a loaded machine cannot produce a
negative decode time. The systems take turns within each round, so a slow stretch of the machine hits them all alike;
rounds go on past `repeats` while a spread exceeds `max_spread`, up to `max_repeats`; a timing still too spread (or
with too few repeats to judge, or a duration that is not positive) is marked unreliable with its reason.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]
MIN_REPEATS = 3  # fewer samples cannot show a spread


@dataclass
class Timing:
    """One phase of one system: the median seconds, the relative spread, and why it is unreliable (None: reliable)."""

    median_s: float | None
    spread: float | None  # (upper quartile - lower quartile) / median
    samples: list[float] = field(default_factory=list)
    reason: str | None = None

    @property
    def reliable(self) -> bool:
        return self.reason is None

    def to_json(self) -> dict:
        return {
            "median_s": self.median_s,
            "spread": self.spread,
            "repeats": len(self.samples),
            "unreliable": self.reason,
        }


def judge(samples: list[float], max_spread: float) -> Timing:
    """The median and relative spread of `samples`, with the reason they cannot be trusted, if any."""
    n = len(samples)
    if n == 0:
        return Timing(None, None, [], "no measurement")
    bad = [s for s in samples if not (math.isfinite(s) and s > 0)]
    if bad:
        return Timing(None, None, list(samples), f"{len(bad)} of {n} durations not positive ({bad[0]:.3g} s)")
    median = statistics.median(samples)
    if n < MIN_REPEATS:
        return Timing(
            median, None, list(samples), f"{n} repeat(s): too few to judge the spread (at least {MIN_REPEATS})"
        )
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    spread = (q3 - q1) / median
    reason = None
    if spread > max_spread:
        reason = f"spread {spread:.0%} over {n} repeats exceeds {max_spread:.0%} (a loaded machine?)"
    return Timing(median, spread, list(samples), reason)


@dataclass
class Phases:
    """How one system is timed: `warmup()` untimed; `prefill(clock)` and `decode(clock)` return their own seconds,
    called in that order within a round (decode may continue the prefill's output)."""

    prefill: Callable[[Clock], float]
    decode: Callable[[Clock], float]
    warmup: Callable[[], object] = lambda: None


def time_phases(
    systems: dict[str, Phases],
    repeats: int,
    max_repeats: int,
    max_spread: float,
    clock: Clock = time.perf_counter,
    on_round: Callable[[int, str], None] | None = None,
    after_round: Callable[[], object] | None = None,
) -> dict[str, dict[str, Timing]]:
    """{label: {"prefill": Timing, "decode": Timing}} after at least max(repeats, MIN_REPEATS) rounds, more (up to
    `max_repeats`) while any spread is above `max_spread`. `on_round(round, label)` reports progress;
    `after_round()` runs after each round's systems (a measurement that must see the same conditions as theirs,
    e.g. the read bandwidth)."""
    for phases in systems.values():
        phases.warmup()
    samples: dict[str, dict[str, list[float]]] = {label: {"prefill": [], "decode": []} for label in systems}
    least = max(repeats, MIN_REPEATS)
    rounds = 0
    while True:
        rounds += 1
        for label, phases in systems.items():
            if on_round is not None:
                on_round(rounds, label)
            samples[label]["prefill"].append(phases.prefill(clock))
            samples[label]["decode"].append(phases.decode(clock))
        if after_round is not None:
            after_round()
        out = {label: {p: judge(s, max_spread) for p, s in ph.items()} for label, ph in samples.items()}
        spread_out = any(t.spread is not None and t.spread > max_spread for ph in out.values() for t in ph.values())
        if rounds >= least and (not spread_out or rounds >= max(max_repeats, least)):
            return out


def rate(tokens: int, timing: Timing) -> float | None:
    """tokens / median seconds, or None when the timing is unreliable."""
    return tokens / timing.median_s if timing.reliable else None


def ratio(ours: float | None, ours_reason: str | None, ref: float | None, ref_reason: str | None, name: str = "HF"):
    """(ours / ref, None), or (None, why no ratio is given): never a ratio from an unreliable timing."""
    if ours_reason or ours is None:
        return None, f"unreliable: ours: {ours_reason or 'no timing'}"
    if ref_reason or ref is None:
        return None, f"unreliable: {name}: {ref_reason or 'no timing'}"
    return ours / ref, None

"""Recorded references: a JSONL file with one Generation per line, written with `+record=path.jsonl`.

Every line's `meta` carries the recording's identity: the model type, a fingerprint of the weights (and config),
the dtype, max_new_tokens, top_k and eos, plus where the generations came from (`source`: hf, vllm, or hybridcache
with its cache plan). A replay checks that identity and every prompt's token ids before anything is compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridcache.paths import write_atomically
from hybridcache.reference.base import Generation, ReferenceRunner

IDENTITY = ("model_type", "weights", "dtype", "packed_weights")


class RecordingMismatch(ValueError):
    """A recording made with another model, weights, dtype, prompts or settings than the run replaying it."""


def write_jsonl(path: str | Path, generations: list[Generation], meta: dict | None = None) -> Path:
    """One JSON line per generation, each with `meta`, written whole or not at all (hybridcache.paths.write_atomically:
    a full disk leaves no partial recording; a new file gets 0666 & ~umask like a plain open)."""
    path = Path(path).expanduser()
    rows = []
    for g in generations:
        row = g.to_json()
        row["meta"] = {**row.get("meta", {}), **(meta or {})}
        rows.append(json.dumps(row) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(rows))
    return path


def check_identity(path: Path, recorded: dict[str, Any], expect: dict[str, Any]) -> None:
    """Refuse a recording whose identity differs from this run's (`expect`), naming what differs."""
    if "weights" not in recorded:
        raise RecordingMismatch(
            f"{path} does not say which model and weights made it (recorded before identities "
            "were stored); record it again with +record=PATH.jsonl"
        )
    what = {
        "model_type": "model type",
        "weights": "weights fingerprint",
        "dtype": "dtype",
        "packed_weights": "model.weights",
    }
    for key in IDENTITY:
        if key in expect and recorded.get(key) != expect[key]:
            hint = " (another checkpoint or seed)" if key == "weights" else ""
            raise RecordingMismatch(
                f"{path} was recorded with {what[key]} {recorded.get(key)!r}{hint}, this run has {expect[key]!r} "
                f"(recorded from {recorded.get('checkpoint', '?')}); replay it with the same model and settings, or "
                "record it again for this one"
            )
    for key in ("max_new_tokens", "top_k"):
        have, want = recorded.get(key), expect.get(key)
        if have is not None and want is not None and int(have) < int(want):
            raise RecordingMismatch(
                f"{path} was recorded with {key}={have}, this run asks for {want}; set {key}<={have} or record it again"
            )


class FileRunner(ReferenceRunner):
    """Replays recorded generations, matched by prompt token ids. With `expect` (this run's identity) and `prompts`,
    a recording of another model, weights, dtype, prompts or settings is refused at construction."""

    name = "file"

    def __init__(
        self, path: str | Path, expect: dict[str, Any] | None = None, prompts: list[list[int]] | None = None
    ) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"reference file {self.path} does not exist (record one with +record=PATH.jsonl)")
        self.records: dict[tuple[int, ...], Generation] = {}
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                g = Generation.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.path}:{n}: not a recorded generation ({e})") from None
            self.records[tuple(g.prompt)] = g
        if not self.records:
            raise ValueError(f"{self.path} holds no recorded generations")
        self.meta: dict[str, Any] = dict(next(iter(self.records.values())).meta)
        if expect is not None:
            check_identity(self.path, self.meta, expect)
        if prompts is not None:
            for i, prompt in enumerate(prompts):
                self._find(prompt, i)

    @property
    def source(self) -> str:
        """Where the recorded generations came from: hf, vllm or hybridcache (our own, under `meta['cache']`)."""
        return str(self.meta.get("source", "?"))

    def _find(self, prompt: list[int], i: int) -> Generation:
        g = self.records.get(tuple(prompt))
        if g is None:
            raise RecordingMismatch(
                f"{self.path} has no recording for prompt {i} ({len(prompt)} tokens starting {prompt[:8]}); it was "
                f"recorded for {len(self.records)} other prompt(s): record it again with the same prompts"
            )
        return g

    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, progress=None) -> list[Generation]:
        out = []
        for i, prompt in enumerate(prompts):
            g = self._find(prompt, i)
            recorded = g.meta.get("max_new_tokens")
            if recorded is not None and recorded < max_new_tokens:
                raise RecordingMismatch(
                    f"{self.path}: recorded with max_new_tokens={recorded}, this run asks for {max_new_tokens}"
                )
            trimmed = Generation(
                g.prompt,
                g.tokens[:max_new_tokens],
                g.token_logprobs[:max_new_tokens],
                g.top_logprobs[:max_new_tokens],
                g.seconds,
                g.meta,
            )
            out.append(trimmed)
            if progress is not None:
                progress()
        return out

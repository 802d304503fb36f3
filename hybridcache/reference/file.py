"""Recorded references: a JSONL file with one Generation per line, written with `+record=path.jsonl`.

Every line's `meta` carries the recording's identity: the model type, a fingerprint of the weights (and config),
the dtype, max_new_tokens, top_k and eos, plus where the generations came from (`source`: hf, vllm, or hybridcache
with its cache plan). A replay checks every line before anything is compared: each is a well-formed generation
(`Generation.from_json`), its meta fields have their types, every line has the first line's identity and settings,
and the identity and every prompt's token ids are this run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridcache.reference.base import Generation, MalformedGeneration, ReferenceRunner
from hybridcache.util.atomic_files import write_output

IDENTITY = ("model_type", "weights", "dtype", "packed_weights")


class RecordingMismatch(ValueError):
    """A recording made with another model, weights, dtype, prompts or settings than the run replaying it."""


def write_jsonl(path: str | Path, generations: list[Generation], meta: dict | None = None) -> Path:
    """One JSON line per generation, each with `meta`, written whole or not at all (atomic_files.write_output:
    a full disk leaves no partial recording; a new file gets 0666 & ~umask like a plain open)."""
    path = Path(path).expanduser()
    rows = []
    for g in generations:
        row = g.to_json()
        row["meta"] = {**row.get("meta", {}), **(meta or {})}
        rows.append(json.dumps(row) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output(path, "".join(rows))
    return path


#: The types of the meta fields a replay reads (int fields: not bools); other fields are kept as they are.
META_TYPES: dict[str, tuple[type, ...]] = {
    "model_type": (str,),
    "weights": (str,),
    "dtype": (str,),
    "packed_weights": (str, type(None)),
    "max_new_tokens": (int,),
    "top_k": (int,),
    "eos_token_id": (int, type(None)),
    "source": (str,),
    "checkpoint": (str,),
    "cache": (str, type(None)),
    "plan": (list, type(None)),
}


def check_meta(meta: dict[str, Any]) -> None:
    """Each field a replay reads has its type (a string where an int goes is named here, not met later)."""
    for key, types in META_TYPES.items():
        if key not in meta:
            continue
        value = meta[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise MalformedGeneration(f"meta.{key} must be {want}, got {type(value).__name__} {value!r:.40}")
        if key in ("max_new_tokens", "top_k") and value < 1:
            raise MalformedGeneration(f"meta.{key} must be >= 1, got {value}")
        if key == "plan" and value is not None and not all(isinstance(r, dict) for r in value):
            raise MalformedGeneration("meta.plan must be a list of cache-layer records (JSON objects)")


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
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise MalformedGeneration(f"{self.path} is not UTF-8 text (byte {e.start}); not a recording") from None
        self.records: dict[tuple[int, ...], Generation] = {}
        lines: dict[tuple[int, ...], int] = {}
        first: tuple[int, dict[str, Any]] | None = None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                g = Generation.from_json(json.loads(line))
                check_meta(g.meta)
            except (ValueError, RecursionError) as e:  # JSONDecodeError and MalformedGeneration are ValueErrors
                raise MalformedGeneration(f"{self.path}:{n}: not a recorded generation ({e})") from None
            if first is None:
                first = n, g.meta
            else:  # every line was recorded by the same run: the same identity and settings as the first
                for key in (*IDENTITY, "max_new_tokens", "top_k", "eos_token_id", "source"):
                    if g.meta.get(key) != first[1].get(key):
                        raise RecordingMismatch(
                            f"{self.path}:{n} was recorded with {key} {g.meta.get(key)!r:.60}, line {first[0]} with "
                            f"{first[1].get(key)!r:.60}: one recording holds one run's generations"
                        )
            key = tuple(g.prompt)
            if key in self.records and self.records[key].to_json() != g.to_json():
                raise RecordingMismatch(
                    f"{self.path}:{n} records prompt {list(key[:8])}... again with another generation than line "
                    f"{lines[key]}; which one to compare with is not clear"
                )
            self.records[key], lines[key] = g, lines.get(key, n)
        if not self.records:
            raise MalformedGeneration(f"{self.path} holds no recorded generations")
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

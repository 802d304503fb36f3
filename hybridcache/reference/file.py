"""Recorded references: a JSONL file with one Generation per line, written with `+record=path.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

from hybridcache.reference.base import Generation, ReferenceRunner


def write_jsonl(path: str | Path, generations: list[Generation], meta: dict | None = None) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in generations:
            row = g.to_json()
            row["meta"] = {**row.get("meta", {}), **(meta or {})}
            f.write(json.dumps(row) + "\n")
    return path


class FileRunner(ReferenceRunner):
    """Replays recorded generations, matched by prompt token ids."""

    name = "file"

    def __init__(self, path: str | Path) -> None:
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

    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, progress=None) -> list[Generation]:
        out = []
        for prompt in prompts:
            g = self.records.get(tuple(prompt))
            if g is None:
                raise ValueError(f"{self.path} has no recording for a prompt of {len(prompt)} tokens "
                                 f"starting {prompt[:8]}; record it again with the same prompts and model")
            recorded = g.meta.get("max_new_tokens")
            if recorded is not None and recorded < max_new_tokens:
                raise ValueError(f"{self.path}: recorded with max_new_tokens={recorded}, this run asks for {max_new_tokens}")
            trimmed = Generation(g.prompt, g.tokens[:max_new_tokens], g.token_logprobs[:max_new_tokens],
                                 g.top_logprobs[:max_new_tokens], g.seconds, g.meta)
            out.append(trimmed)
            if progress is not None:
                progress()
        return out

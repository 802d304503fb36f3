"""Weights & Biases logging, offline by default: works with no account and no network."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Tracker:
    """A thin wrapper over one wandb run (mode offline | online | disabled)."""

    def __init__(self, mode: str, project: str, directory: str | Path, config: dict[str, Any],
                 group: str | None = None, name: str | None = None, tags: list[str] | None = None) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {mode!r}")
        import wandb

        self.wandb = wandb
        self.mode = mode
        Path(directory).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=project, mode=mode, dir=str(directory), config=config, group=group,
                              name=name, tags=tags, reinit="finish_previous")

    @property
    def run_dir(self) -> Path | None:
        """The local run directory (offline: sync it later with `wandb sync DIR`)."""
        if self.mode == "disabled" or self.run is None:
            return None
        return Path(self.run.dir).parent

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)})

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def log(self, values: dict[str, Any]) -> None:
        self.run.log(values)

    def finish(self) -> None:
        self.run.finish()

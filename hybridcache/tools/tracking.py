"""Weights & Biases logging, offline by default: works with no account and no network.

A `Tracker` never loses results to a logging failure: if `wandb.init` fails (online without an API key, no network,
a broken install) or any later call fails, it records the error in `tracker.error`, turns itself off and the run goes
on; callers write their results file first. Everything W&B writes (run files, artifact staging, its cache) stays in
the directory it is given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Tracker:
    """A thin, failure-proof wrapper over one wandb run (mode offline | online | disabled)."""

    def __init__(
        self,
        mode: str,
        project: str,
        directory: str | Path,
        config: dict[str, Any],
        group: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        job_type: str | None = None,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {mode!r}")
        self.mode, self.run, self.wandb, self.error = mode, None, None, None
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if mode == "disabled":
            return
        keep_inside(self.directory)
        try:
            import wandb

            self.wandb = wandb
            self.run = wandb.init(
                project=project,
                mode=mode,
                dir=str(self.directory),
                config=config,
                group=group,
                name=name,
                tags=tags,
                job_type=job_type,
                reinit="finish_previous",
            )
        except BaseException as e:  # noqa: BLE001 - W&B must never cost the results (it may even sys.exit)
            if isinstance(e, KeyboardInterrupt):
                raise
            self._failed("wandb.init", e)

    def _failed(self, what: str, e: BaseException) -> None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self.error = self.error or f"{what} failed ({type(e).__name__}: {first})"
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except BaseException:  # noqa: BLE001
                pass

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        if self.run is None:
            return
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self._failed(what, e)

    @property
    def active(self) -> bool:
        return self.run is not None

    @property
    def run_dir(self) -> Path | None:
        """The local run directory (offline: upload it later with `wandb sync <run_dir>`)."""
        if self.run is None:
            return None
        try:
            return Path(self.run.dir).parent
        except BaseException:  # noqa: BLE001
            return None

    @property
    def sync_command(self) -> str | None:
        """The exact command that uploads this offline run, or None (online, disabled or failed)."""
        if self.mode != "offline" or self.run_dir is None:
            return None
        return f"wandb sync {self.run_dir}"

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self._call(f"logging table {key}", lambda: self.run.log({key: self.wandb.Table(columns=columns, data=rows)}))

    def image(self, key: str, path: str | Path, caption: str | None = None) -> None:
        """Log a PNG as a W&B image (the media panel)."""
        self._call(f"logging image {key}", lambda: self.run.log({key: self.wandb.Image(str(path), caption=caption)}))

    def scatter(
        self, key: str, points: list[tuple[str, float, float]], x: str, y: str, title: str = "", label: str = "name"
    ) -> None:
        """A native W&B scatter plot of (label, x, y) points, its table logged under `key` too."""

        def log() -> None:
            table = self.wandb.Table(columns=[label, x, y], data=[list(p) for p in points])
            self.run.log({key: self.wandb.plot.scatter(table, x, y, title=title or key)})

        self._call(f"logging scatter {key}", log)

    def line(
        self, key: str, points: list[tuple[str, float, float]], x: str, y: str, title: str = "", series: str = "series"
    ) -> None:
        """A native W&B line plot of (series, x, y) points, one line per series."""

        def log() -> None:
            table = self.wandb.Table(columns=[series, x, y], data=[list(p) for p in points])
            self.run.log({key: self.wandb.plot.line(table, x, y, stroke=series, title=title or key)})

        self._call(f"logging line {key}", log)

    def bar(
        self,
        key: str,
        labels: list[str],
        values: list[float],
        label: str = "label",
        value: str = "value",
        title: str = "",
    ) -> None:
        """A native W&B bar chart, one bar per label."""

        def log() -> None:
            table = self.wandb.Table(columns=[label, value], data=[[a, v] for a, v in zip(labels, values)])
            self.run.log({key: self.wandb.plot.bar(table, label, value, title=title or key)})

        self._call(f"logging bar chart {key}", log)

    def summary(self, values: dict[str, Any]) -> None:
        def write() -> None:
            for k, v in values.items():
                if v is not None:
                    self.run.summary[k] = v

        self._call("writing the summary", write)

    def config(self, values: dict[str, Any]) -> None:
        self._call("updating the config", lambda: self.run.config.update(values, allow_val_change=True))

    def log(self, values: dict[str, Any]) -> None:
        self._call("logging", lambda: self.run.log(values))

    def save(self, path: str | Path) -> None:
        """Attach a file (e.g. console.log, results.json) to the run."""
        self._call(f"saving {path}", lambda: self.run.save(str(path), base_path=str(Path(path).parent), policy="now"))

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish()
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self.error = self.error or f"wandb finish failed ({type(e).__name__}: {e})"


def keep_inside(directory: Path) -> None:
    """Point W&B's run, staging, artifact and cache directories into `directory` (not ~/.cache, ~/.local or /tmp).
    The settings directory (WANDB_CONFIG_DIR: login, default entity) is left where the user keeps it."""
    root = directory / "wandb"
    os.environ["WANDB_DIR"] = str(directory)
    os.environ["WANDB_DATA_DIR"] = str(root / "staging")
    os.environ["WANDB_ARTIFACT_DIR"] = str(root / "artifacts")
    os.environ["WANDB_CACHE_DIR"] = str(root / "cache")
    os.environ.setdefault("WANDB_SILENT", "true")

"""One place that builds a run's output directory, title, W&B group and W&B run (a `Tracker`), and writes its
results (experiments.core.results: atomic, schema-versioned).

Every experiment starts with `ctx = RunContext.create(cfg, ...)`, logs through `ctx.start_tracker(...)` and writes
with `ctx.write(result)`; a run stopped by a user error gets its results.json from `write_error_result`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.core.results import RESULTS, write_results

#: Overrides left out of titles: where things go and how they are logged, not what is measured.
_NOT_IN_TITLE = ("hydra.", "logger.", "+record", "record", "home")


def output_dir() -> Path:
    """Hydra's output directory of this run (this job's, in a sweep); ValueError when not under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def task_overrides() -> list[str]:
    """The command-line overrides of this run (this job's, in a sweep), without hydra.* and logging ones."""
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        return []
    return [o for o in overrides if not o.lstrip("~+").startswith(_NOT_IN_TITLE)]


def run_title(cfg: DictConfig) -> str:
    """model · cache · reference, plus every other override, so runs of a sweep have different titles."""
    shown = {"model", "cache", "reference"}
    extra = [o for o in task_overrides() if o.lstrip("~+").split("=")[0] not in shown]
    model = cfg.get("model_name") or cfg.model.family
    if cfg.get("engine") == "hf" and cfg.model.get("checkpoint"):  # the checkpoint decides the model, not model=
        model = f"{Path(str(cfg.model.checkpoint)).name} (HF)"
    title = f"{model} · cache={cfg.get('cache_name', '?')} · reference={cfg.reference.name}"
    return title + (" · " + " ".join(extra) if extra else "")


def sweep_group(cfg: DictConfig) -> str | None:
    """W&B group: logger.group, else in a sweep "sweep-<date>-<time>" from the sweep directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.logger.group:
        return str(cfg.logger.group)
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not under Hydra
        return None
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep = Path(hydra_cfg.sweep.dir)
    return f"sweep-{sweep.parent.name}-{sweep.name}"


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, interpolations resolved (unresolved when one fails: preflight reports it)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001
        return OmegaConf.to_container(cfg, resolve=False)


@dataclass
class RunContext:
    """A run's output directory, title, W&B group, config (plain data) and, once started, its Tracker."""

    cfg: DictConfig
    out_dir: Path
    title: str
    group: str | None
    config: dict[str, Any]
    tracker: Any = None  # hybridcache.tools.tracking.Tracker, after start_tracker
    results_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.results_path = self.out_dir / RESULTS

    @classmethod
    def create(cls, cfg: DictConfig, title: str | None = None, out_dir: str | Path | None = None) -> RunContext:
        """The run's context; `title` defaults to `run_title(cfg)`, `out_dir` to Hydra's output directory."""
        out = Path(out_dir) if out_dir is not None else output_dir()
        out.mkdir(parents=True, exist_ok=True)
        return cls(cfg, out, title or run_title(cfg), sweep_group(cfg), resolved_config(cfg))

    def start_tracker(
        self,
        name: str | None = None,
        tags: list[str] | None = None,
        config: dict[str, Any] | None = None,
        job_type: str | None = None,
    ):
        """The run's W&B run (offline by default; a Tracker never raises, see hybridcache.tools.tracking)."""
        from hybridcache.tools.tracking import Tracker

        self.tracker = Tracker(
            self.cfg.logger.mode,
            self.cfg.logger.project,
            self.out_dir,
            self.config if config is None else config,
            group=self.group,
            name=name or self.title,
            tags=tags,
            job_type=job_type,
        )
        return self.tracker

    def write(self, result: dict[str, Any], name: str = RESULTS) -> Path:
        """`result` to out_dir/name, atomically, with schema_version (experiments.core.results)."""
        return write_results(self.out_dir, result, name)

    def base(self, status: str) -> dict[str, Any]:
        """The keys every results.json starts with."""
        return {"status": status, "title": self.title, "overrides": task_overrides(), "config": self.config}


def write_error_result(cfg: DictConfig, message: str, exit_code: int = 2) -> None:
    """results.json for a run stopped by a user error or a failed reference (so sweeps and scripts see why)."""
    try:
        out = output_dir()
    except ValueError:  # not under Hydra
        return
    result = {
        "status": "error",
        "error": message,
        "exit_code": exit_code,
        "title": run_title(cfg),
        "overrides": task_overrides(),
        "config": OmegaConf.to_container(cfg, resolve=False),
    }
    write_results(out, result)

"""Experiments run by run.py, chosen with experiment=<name>.

`run_experiment` never lets a user error (a bad setting, a missing file) escape as a traceback: it prints one line
and records a non-zero exit status in `EXIT`, which run.py returns once Hydra is done (after every job of a sweep).
"""

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.config_schema import register as register_schemas

EXPERIMENTS = {
    "correctness": "experiments.correctness",
    "benchmark": "experiments.benchmark",
    "study": "experiments.study",
    "press_check": "experiments.press_check",
    "train": "experiments.train",
}


@dataclass
class ExitStatus:
    code: int = 0

    def fail(self, code: int) -> None:
        self.code = max(self.code, code)


EXIT = ExitStatus()


def _real_checkpoint(name: str, home: str | None = None) -> str:
    """`${real:NAME,HOME}` (model=gemma3_270m): hybridcache.real_checkpoints' resolver, imported on first use so that
    `import experiments` stays light (run.py checks the command line before torch is imported; experiments.usage)."""
    from hybridcache.real_checkpoints import real_checkpoint

    return str(real_checkpoint(str(name), root=Path(str(home)).expanduser() / "real" if home else None))


register_schemas()  # the structured configs the YAML files extend (experiments/config_schema.py)

if not OmegaConf.has_resolver("real"):  # registered for every experiment (hybridcache.real_checkpoints skips its own)
    OmegaConf.register_new_resolver("real", _real_checkpoint)


def run_experiment(cfg: DictConfig):
    from experiments.common import UserError, real_checkpoint_missing, write_error_result

    name = cfg.experiment.name
    try:
        if name not in EXPERIMENTS:
            raise UserError(f"experiment={name} is not one of {', '.join(EXPERIMENTS)}")
        result = importlib.import_module(EXPERIMENTS[name]).run(cfg)
    except Exception as e:  # UserError and ReferenceFailed (exit status 3); a real checkpoint's missing extra
        missing = None if isinstance(e, UserError) else real_checkpoint_missing(e)
        if missing:
            e = UserError(f"model: {missing}")
        elif not isinstance(e, UserError):
            raise
        print(f"error: {e}", file=sys.stderr)
        write_error_result(cfg, str(e), e.exit_code)
        EXIT.fail(e.exit_code)
        return None
    if isinstance(result, dict) and result.get("exit_code"):
        EXIT.fail(int(result["exit_code"]))
    return result

"""Experiments run by run.py, chosen with experiment=<name>.

`run_experiment` never lets a user error (a bad setting, a missing file) escape as a traceback: it prints one line
and records a non-zero exit status in `EXIT`, which run.py returns once Hydra is done (after every job of a sweep).
"""

import importlib
import sys
from dataclasses import dataclass

from omegaconf import DictConfig

import hybridcache.real_checkpoints  # noqa: F401 - registers ${real:NAME} (model=gemma3_270m) for every experiment

EXPERIMENTS = {"correctness": "experiments.correctness", "benchmark": "experiments.benchmark", "study": "experiments.study",
               "press_check": "experiments.press_check", "train": "experiments.train"}


@dataclass
class ExitStatus:
    code: int = 0

    def fail(self, code: int) -> None:
        self.code = max(self.code, code)


EXIT = ExitStatus()


def run_experiment(cfg: DictConfig):
    from experiments.common import UserError, write_error_result

    name = cfg.experiment.name
    try:
        if name not in EXPERIMENTS:
            raise UserError(f"experiment={name} is not one of {', '.join(EXPERIMENTS)}")
        result = importlib.import_module(EXPERIMENTS[name]).run(cfg)
    except UserError as e:  # and ReferenceFailed (exit status 3)
        print(f"error: {e}", file=sys.stderr)
        write_error_result(cfg, str(e), e.exit_code)
        EXIT.fail(e.exit_code)
        return None
    if isinstance(result, dict) and result.get("exit_code"):
        EXIT.fail(int(result["exit_code"]))
    return result

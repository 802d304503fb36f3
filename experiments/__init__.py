"""Experiments run by run.py, chosen with experiment=<name>.

`run_experiment` never lets a user error (a bad setting, a missing file), a failed reference or an OS refusal (a full
disk) escape as a traceback: it prints one line and records a non-zero exit status in `EXIT`, which run.py returns
once Hydra is done (after every job of a sweep); `run_cli` does the same for an OS refusal around the run (Hydra
creating the output directory).
"""

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.core.config_schema import register as register_schemas
from experiments.core.value_checks import HF_ENGINE, engine_problem

EXPERIMENTS = {
    "correctness": "experiments.correctness.main",
    "benchmark": "experiments.benchmark.main",
    "study": "experiments.study.main",
    "long_context": "experiments.long_context.main",
    "press_check": "experiments.press_check.main",
    "train": "experiments.train.main",
    "drift": "experiments.drift.main",
}


@dataclass
class ExitStatus:
    code: int = 0

    def fail(self, code: int) -> None:
        self.code = max(self.code, code)


EXIT = ExitStatus()


def _real_checkpoint(name: str, home: str | None = None) -> str:
    """`${real:NAME,HOME}` (model=gemma3_270m): hybridcache.checkpoints.real' resolver, imported on first use so that
    `import experiments` stays light (run.py checks the command line before torch is imported;
    experiments.core.usage)."""
    from hybridcache.checkpoints.real import real_checkpoint

    return str(real_checkpoint(str(name), root=Path(str(home)).expanduser() / "real" if home else None))


register_schemas()  # the structured configs the YAML files extend (experiments/core/config_schema.py)

if not OmegaConf.has_resolver("real"):  # registered for every experiment (hybridcache.checkpoints.real skips its own)
    OmegaConf.register_new_resolver("real", _real_checkpoint)


def run_experiment(cfg: DictConfig):
    from experiments.core.common import UserError, real_checkpoint_missing, write_error_result
    from experiments.core.errors import environment_failure, one_line

    name = cfg.experiment.name
    try:
        if name not in EXPERIMENTS:
            raise UserError(f"experiment={name} is not one of {', '.join(EXPERIMENTS)}")
        if cfg.get("engine", "ours") == "hf" and name not in HF_ENGINE:  # (run.py refuses it before, value_checks)
            raise UserError(engine_problem(name))
        result = importlib.import_module(EXPERIMENTS[name]).run(cfg)
    except Exception as e:  # UserError, ReferenceFailed (3), an OS refusal (4), a real checkpoint's missing extra
        missing = None if isinstance(e, UserError) else real_checkpoint_missing(e)
        if missing:
            e = UserError(f"model: {missing}")
        elif not isinstance(e, UserError):
            failure = environment_failure(e)
            if failure is None:
                raise
            e = failure
        message = one_line(str(e))
        print(f"error: {message}", file=sys.stderr)
        try:
            write_error_result(cfg, message, e.exit_code)
        except OSError:  # the disk that refused the run may refuse its error record too: the line above says it
            pass
        EXIT.fail(e.exit_code)
        return None
    if isinstance(result, dict) and result.get("exit_code"):
        EXIT.fail(int(result["exit_code"]))
    return result


def _reraise(e: BaseException):
    raise e


def run_cli(main) -> int:
    """Run Hydra's `main()` and return the exit status. An OS refusal before the run or around it (the output
    directory under a file, on a full disk, under /proc) is one line and status 4 like one inside it, not Hydra's
    traceback with status 1; any other error is reported by Hydra as before (HYDRA_FULL_ERROR=1 still shows all)."""
    from experiments.core.errors import environment_failure

    full = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing: an OS refusal is told apart below
    try:
        main()
    except Exception as e:  # noqa: BLE001 - reported here or by Hydra
        failure = environment_failure(e)
        _restore("HYDRA_FULL_ERROR", full)
        if failure is None:
            if full == "1":
                raise
            from hydra._internal.utils import run_and_report

            tb = e.__traceback__  # from Hydra's run_job on, as Hydra would have shown it
            while tb is not None and tb.tb_frame.f_code.co_name != "run_job":
                tb = tb.tb_next
            error = e if tb is None else e.with_traceback(tb)
            run_and_report(lambda: _reraise(error))  # its traceback, exit status 1
            raise
        print(f"error: {failure}", file=sys.stderr)
        EXIT.fail(failure.exit_code)
    finally:
        _restore("HYDRA_FULL_ERROR", full)
    return EXIT.code


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value

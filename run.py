"""hybridcache's command line: `python run.py model=jamba cache=hybrid_chunked` (Hydra; see README)."""

import os
import sys
from pathlib import Path

# Quiet third-party progress bars and advisory warnings before they are imported (see experiments.core.common.quiet).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
# A unique suffix for output directories (runs started in the same microsecond still differ by process id).
OmegaConf.register_new_resolver("hc_pid", lambda: str(os.getpid()), use_cache=True, replace=True)


@hydra.main(config_path=str(CONFIGS), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from experiments import run_experiment

    run_experiment(cfg)  # records its exit status in experiments.EXIT (user errors: one line, no traceback)


if __name__ == "__main__":
    from experiments.core.help import exit_on_help
    from experiments.core.usage import exit_on_usage_error

    exit_on_help(sys.argv[1:], CONFIGS)  # what the app does, its choices and examples (Hydra's: --hydra-help)
    exit_on_usage_error(sys.argv[1:], CONFIGS)  # a usage error: one line, exit status 2, before torch is imported
    from experiments import run_cli

    sys.exit(run_cli(main))  # the worst status of the run(s); an OS refusal around them is one line too

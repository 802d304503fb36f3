"""hybridcache's command line: `python run.py model=jamba cache=hybrid_chunked` (Hydra; see README)."""

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from experiments import run_experiment

    run_experiment(cfg)


if __name__ == "__main__":
    main()

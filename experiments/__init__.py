"""Experiments run by run.py, chosen with experiment=<name>."""

import importlib

from omegaconf import DictConfig

EXPERIMENTS = {"correctness": "experiments.correctness", "benchmark": "experiments.benchmark"}


def run_experiment(cfg: DictConfig):
    name = cfg.experiment.name
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment '{name}' (known: {', '.join(EXPERIMENTS)})")
    return importlib.import_module(EXPERIMENTS[name]).run(cfg)

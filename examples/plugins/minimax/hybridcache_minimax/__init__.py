"""MiniMax as a hybridcache plugin: the `lightning` cache type (lightning.py) and the `minimax` family (model.py)."""

from hybridcache_minimax.lightning import LightningSpec, LightningStateLayer
from hybridcache_minimax.model import MiniMaxConfig, MiniMaxLM

__all__ = ["LightningSpec", "LightningStateLayer", "MiniMaxConfig", "MiniMaxLM"]

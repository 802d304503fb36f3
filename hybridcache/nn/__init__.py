"""The model's torch modules (nn.Modules): mixers, MLPs, MoE, norms. A mixer receives its own cache layer and talks
only to it."""

from hybridcache.nn.attention.mixer import AttentionMixer
from hybridcache.nn.attention.rotary import RotaryEmbedding
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.mlp import ACTIVATIONS, GatedMLP
from hybridcache.nn.core.norms import RMSNorm, residual_norm

__all__ = ["ACTIVATIONS", "AttentionMixer", "GatedMLP", "RMSNorm", "RotaryEmbedding", "StepInput", "residual_norm"]

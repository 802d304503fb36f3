"""Model building blocks (nn.Modules). A mixer receives its own cache layer and talks only to it."""

from hybridcache.blocks.attention.mixer import AttentionMixer
from hybridcache.blocks.attention.rotary import RotaryEmbedding
from hybridcache.blocks.core.common import StepInput
from hybridcache.blocks.core.mlp import ACTIVATIONS, GatedMLP
from hybridcache.blocks.core.norms import RMSNorm, residual_norm

__all__ = ["ACTIVATIONS", "AttentionMixer", "GatedMLP", "RMSNorm", "RotaryEmbedding", "StepInput", "residual_norm"]

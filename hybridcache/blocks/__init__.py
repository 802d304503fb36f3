"""Model building blocks (nn.Modules). A mixer receives its own cache layer and talks only to it."""

from hybridcache.blocks.attention import AttentionMixer
from hybridcache.blocks.common import StepInput
from hybridcache.blocks.mlp import ACTIVATIONS, GatedMLP
from hybridcache.blocks.norms import RMSNorm, residual_norm
from hybridcache.blocks.rotary import RotaryEmbedding

__all__ = ["ACTIVATIONS", "AttentionMixer", "GatedMLP", "RMSNorm", "RotaryEmbedding", "StepInput", "residual_norm"]

"""Pure functional ops for hybrid-LM caches.

Every op takes its recurrent/convolutional state explicitly and returns the new
state, so a sequence can be processed in arbitrary splits. Pure-torch reference
implementations are the default; the CUDA kernels of ``mamba_ssm`` and
``causal_conv1d`` are used only for CUDA tensors when those packages import.
"""

from .attention import masked_attention
from .conv import causal_conv1d, causal_conv1d_step
from .gated_delta import gated_delta_rule, gated_delta_step
from .rglru import linear_recurrence
from .selective_scan import selective_scan, selective_state_update
from .ssd import ssd_scan, ssd_step

__all__ = [
    "masked_attention",
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_delta_rule",
    "gated_delta_step",
    "selective_scan",
    "selective_state_update",
    "ssd_scan",
    "ssd_step",
    "linear_recurrence",
]

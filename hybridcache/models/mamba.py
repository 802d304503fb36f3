"""Mamba (v1) language model: pre-norm Mamba mixer blocks, optionally with a float32 residual stream."""

from __future__ import annotations

from hybridcache.blocks.mamba import MambaMixer, resolve_dt_rank
from hybridcache.cache import NativeLayer
from hybridcache.models.ssm_lm import SSMLM

# HF MambaConfig defaults for keys a config.json may leave out.
DEFAULTS = {
    "state_size": 16, "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
    "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "residual_in_fp32": True, "time_step_rank": "auto",
    "tie_word_embeddings": True,
}


def intermediate_size(config: dict) -> int:
    return int(config.get("intermediate_size") or config["expand"] * config["hidden_size"])


class MambaLM(SSMLM):
    family = "mamba"

    def __init__(self, config: dict) -> None:
        super().__init__({**DEFAULTS, **{k: v for k, v in config.items() if v is not None}})

    @staticmethod
    def make_mixer(config: dict) -> MambaMixer:
        d = config["hidden_size"]
        return MambaMixer(
            d, intermediate_size(config), config["state_size"], config["conv_kernel"],
            resolve_dt_rank(config["time_step_rank"], d), conv_bias=config["use_conv_bias"],
            proj_bias=config["use_bias"], activation=config["hidden_act"],
        )

    def native_layers(self) -> list[NativeLayer]:
        c = self.config
        params = {"intermediate_size": intermediate_size(c), "state_size": c["state_size"],
                  "conv_kernel": c["conv_kernel"], "dtype": self.dtype}
        return [NativeLayer("mamba", params) for _ in range(c["num_hidden_layers"])]

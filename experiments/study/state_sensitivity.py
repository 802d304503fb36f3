"""Per-layer sensitivity of a hybrid model to its recurrent state codec (`state_codec`, cache/recurrent/codecs.py).

For a token sequence, the prompt is fed as one block and every later token as its own block (teacher forcing,
as decoding would feed them), so the state is encoded after every token, as in a generation. For each recurrent
cache layer and each codec, only that layer holds its state in the codec (every other layer stays as configured,
float32 by default), and the logits of the continuation are compared with the all-exact run:
    kl            mean over positions and rows of KL(reference || codec) of the next-token distributions
    nll_increase  mean NLL of the actual next tokens minus the reference's
    max_abs_dlogit  max |logit - reference logit|
A codec that is exact for the layer's state dtype (dense, float32 for float32 states) gives 0 for all three.

    rows = layer_sensitivity(model, ids, prompt_len=16, codecs=("bfloat16", "int8", "int4"))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

DEFAULT_CODECS = ("bfloat16", "float8_e4m3fn", "int8", "int4")


@torch.no_grad()
def stepwise_logits(
    model: Any, ids: torch.Tensor, prompt_len: int, cache_config: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Logits [B, T - prompt_len, V] (float32) predicting ids[:, prompt_len:]: the prompt in one block, then one
    token per block."""
    batch, total = ids.shape
    if not 0 < prompt_len < total:
        raise ValueError(f"prompt_len must be in [1, {total - 1}] for a sequence of {total} tokens, got {prompt_len}")
    ids = ids.to(model.device)
    cache = model.make_cache(batch, cache_config)
    out = [model(ids[:, :prompt_len], cache)[:, -1:]]
    for t in range(prompt_len, total - 1):
        out.append(model(ids[:, t : t + 1], cache))
    return torch.cat(out, dim=1).float()


def compare_logits(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(ref || got) and NLL increase (means over rows and positions) and max |Δlogit| of logits [B, T, V]."""
    ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean()
    nll = lambda lp: -lp.gather(-1, targets[..., None]).mean()  # noqa: E731
    return {
        "kl": float(kl.clamp(min=0)),
        "nll_increase": float(nll(got_lp) - nll(ref_lp)),
        "max_abs_dlogit": float((got - ref).abs().max()),
    }


def recurrent_addresses(model: Any) -> list[tuple[str, str]]:
    """(address under `layers:`, cache type) of every recurrent cache layer of the model's native plan."""
    return [(p.address, p.type) for p in model.make_cache(1).plan.layers if p.kind == "recurrent"]


def layer_sensitivity(
    model: Any,
    ids: torch.Tensor,
    prompt_len: int,
    codecs: Sequence[str] = DEFAULT_CODECS,
    params: Mapping[str, Any] | None = None,
    base_config: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per (recurrent layer, codec): the increase when only that layer holds its state in `codec` (with
    `params`, e.g. {"state_group": "head", "quantize_conv": True}); `base_config` is the reference cache config."""
    ids = ids.to(model.device)
    targets = ids[:, prompt_len:]
    ref = stepwise_logits(model, ids, prompt_len, base_config)
    rows = []
    for address, type_name in recurrent_addresses(model):
        for codec in codecs:
            config = {
                **(base_config or {}),
                "layers": {
                    **dict((base_config or {}).get("layers", {})),
                    address: {"state_codec": codec, **(params or {})},
                },
            }
            got = stepwise_logits(model, ids, prompt_len, config)
            rows.append({"layer": address, "type": type_name, "codec": codec, **compare_logits(ref, got, targets)})
    return rows


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of `layer_sensitivity` rows."""
    lines = [f"{'layer':>8} {'type':>12} {'codec':>14} {'kl':>10} {'nll_increase':>13} {'max|dlogit|':>12}"]
    for r in rows:
        lines.append(
            f"{r['layer']:>8} {r['type']:>12} {r['codec']:>14} {r['kl']:10.3e} {r['nll_increase']:13.3e} "
            f"{r['max_abs_dlogit']:12.3e}"
        )
    return "\n".join(lines)

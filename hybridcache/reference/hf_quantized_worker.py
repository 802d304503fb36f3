"""Standalone worker: HF transformers 5.2's QuantizedCache (quanto backend), run by that environment's python.

    python hf_quantized_worker.py IN.safetensors OUT.safetensors

IN holds `keys` and `values` [B, H, N, D] and, in its metadata, `request`: JSON with `splits` (block lengths summing
to N) and the layer's `nbits`, `axis_key`, `axis_value`, `q_group_size`, `residual_length`. The blocks are fed in
order through one `QuantoQuantizedLayer`; OUT holds `keys.<i>` / `values.<i>`, what `update` returned for block i
(what the attention sees). Imports nothing from hybridcache: it runs in the other environment.

Model mode (`request["mode"] == "model"`): IN holds `prompt_ids` and `cont_ids` [1, N]; the request names a HF-format
`checkpoint` directory. The model (float32, CPU, eager attention) prefills the prompt into a `QuantizedCache(quanto)`
(or a DynamicCache when `nbits` is null: the native baseline), then takes the continuation in one forward; OUT holds
`logits` [T, V]: the prompt's last logits, then the continuation's but its last (those predicting each
continuation token).
"""

import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def run_model(request: dict, data: dict) -> dict:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (the other environment's)
    from transformers.cache_utils import DynamicCache, QuantizedCache  # noqa: PLC0415

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(
        request["checkpoint"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if request["nbits"] is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = QuantizedCache(
            "quanto",
            model.config,
            nbits=request["nbits"],
            axis_key=request["axis_key"],
            axis_value=request["axis_value"],
            q_group_size=request["q_group_size"],
            residual_length=request["residual_length"],
        )
    first = model(input_ids=data["prompt_ids"], past_key_values=cache, use_cache=True).logits[0, -1:]
    rest = model(input_ids=data["cont_ids"], past_key_values=cache, use_cache=True).logits[0, :-1]
    return {"logits": torch.cat([first, rest]).contiguous()}


def main(src: str, dst: str) -> None:
    with safe_open(src, framework="pt") as f:
        request = json.loads(f.metadata()["request"])
    data = load_file(src)
    if request.get("mode") == "model":
        import transformers  # noqa: PLC0415

        save_file(run_model(request, data), dst, metadata={"transformers": transformers.__version__})
        return
    from transformers.cache_utils import QuantoQuantizedLayer  # noqa: PLC0415 (the other environment's)

    keys, values = data["keys"], data["values"]
    layer = QuantoQuantizedLayer(
        nbits=request["nbits"],
        axis_key=request["axis_key"],
        axis_value=request["axis_value"],
        q_group_size=request["q_group_size"],
        residual_length=request["residual_length"],
    )
    out, start = {}, 0
    for i, n in enumerate(request["splits"]):
        k, v = layer.update(keys[:, :, start : start + n], values[:, :, start : start + n])
        out[f"keys.{i}"], out[f"values.{i}"] = k.contiguous(), v.contiguous()
        start += n
    import transformers  # noqa: PLC0415

    save_file(out, dst, metadata={"transformers": transformers.__version__, "torch": torch.__version__})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Runs inside a separate kvpress environment (kvpress 0.5.5, transformers 5.2): one press on one context, then the
teacher-forced NLL of a continuation. Imports only torch, transformers, kvpress, safetensors and the standard library
(never hybridcache: kvpress patches attention functions globally, so it must stay out of our process).

    python kvpress_worker.py request.json answer.json result.safetensors

The context is prefilled under the press with a plain `DynamicCache()`, as kvpress's pipeline does; the continuation
is then fed with `position_ids = context_len + arange` (the pipeline's protocol: the cache holds fewer slots than
positions) and no press, in one forward (`feed: one_forward`, as the pipeline feeds a question) or one token per
forward (`per_token`, as it decodes). The kept original positions per layer and kv head are recovered by matching each
compressed (key, value) row bit for bit to the uncompressed cache (a gather copies rows exactly), and checked by
re-gathering. answer.json holds {"meta": ...} or {"error", "kind"}: kind "reference" when kvpress itself raised (its
prefill kept positions are still written), "unavailable" when kvpress does not import, "worker" for our own bugs.

A request with "decoding" ({"compression_interval", "target_size", "prefill"}) runs kvpress's decoding-time press
instead: DecodingPress around the press (PrefillDecodingPress with the press, at compression_ratio, for the prefill
when "prefill" is true), and the continuation one token per forward INSIDE the press (it compresses while decoding).
Each layer's slots are followed to their original positions across compressions (kvpress reorders slots: a gather
in topk order); written: `held.{layer}` (what each layer holds at the end), `event.{layer}.{k}` (what it held after
its k-th compression; meta "events" gives the continuation step of each, -1 for the prefill), and with "greedy": N,
`greedy` (N tokens decoded greedily from the context in a second run under a fresh press).
"""

import os
import sys
import time
from pathlib import Path

# this file's folder is first on sys.path: drop it so no sibling module can shadow a library
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import logging  # noqa: E402
from contextlib import nullcontext  # noqa: E402

PRESSES = {  # our cache type name -> (kvpress class, needs attention weights)
    "streaming_llm": ("StreamingLLMPress", False),
    "snapkv": ("SnapKVPress", False),
    "knorm": ("KnormPress", False),
    "tova": ("TOVAPress", False),
    "observed_attention": ("ObservedAttentionPress", True),
    "expected_attention": ("ExpectedAttentionPress", False),
    "pyramidkv": ("PyramidKVPress", False),
    "none": (None, False),
}
DTYPES = ("float32", "bfloat16", "float16")
FEEDS = ("one_forward", "per_token")


class PositionsUnrecoverable(Exception):
    """The compressed cache is not a selection of the uncompressed one's rows: a bug here, never a result."""


def make_press(kvpress, name: str, kwargs: dict):
    cls_name, _ = PRESSES[name]
    if cls_name is None:
        return None
    if name == "expected_attention":
        return layer_typed_expected_attention(kvpress)(**kwargs)
    return getattr(kvpress, cls_name)(**kwargs)


def layer_typed_expected_attention(kvpress):
    """ExpectedAttentionPress whose averaged RoPE uses the layer's own rotary table. In transformers 5.2 Gemma 3's
    shared rotary embedding holds one table per layer type and needs `layer_type`; kvpress 0.5.5 calls it without,
    which fails ('None_inv_freq'). Only that call is changed: the module's rotary_emb is wrapped for its duration."""
    import torch

    class LayerTypedRotary(torch.nn.Module):
        def __init__(self, rotary, layer_type):
            super().__init__()
            self.rotary, self.layer_type = rotary, layer_type

        def forward(self, x, position_ids):
            return self.rotary(x, position_ids, self.layer_type)

    class LayerTypedExpectedAttentionPress(kvpress.ExpectedAttentionPress):
        def apply_avg_rope(self, module, mu, cov, q_len):
            layer_type = getattr(module, "layer_type", None)
            if layer_type is None:
                return super().apply_avg_rope(module, mu, cov, q_len)
            shared = module.rotary_emb
            module.rotary_emb = LayerTypedRotary(shared, layer_type)
            try:
                return super().apply_avg_rope(module, mu, cov, q_len)
            finally:
                module.rotary_emb = shared

    return LayerTypedExpectedAttentionPress


def _rows(keys, values, head: int) -> list:
    """Per position, the exact bytes of its (key, value) pair in `head`."""
    import torch

    pair = torch.cat([keys[0, head], values[0, head]], dim=-1).contiguous()  # [T, 2D]
    flat = pair.view(torch.uint8).numpy()  # [T, 2D * itemsize]
    return [flat[i].tobytes() for i in range(flat.shape[0])]


def kept_slots(before: tuple, after: tuple):
    """Original positions of the compressed cache's slots [Hkv, n_kept], in slot order; checked by re-gathering."""
    import torch

    (k0, v0), (k1, v1) = before, after
    if k0.shape[0] != 1 or k1.shape[:2] != k0.shape[:2] or k1.shape[3] != k0.shape[3] or v1.shape != k1.shape:
        raise PositionsUnrecoverable(f"unexpected cache shapes: {tuple(k0.shape)} -> {tuple(k1.shape)}")
    slots = []
    for head in range(k0.shape[1]):
        where: dict = {}
        for i, row in enumerate(_rows(k0, v0, head)):
            where.setdefault(row, []).append(i)
        found = []
        for j, row in enumerate(_rows(k1, v1, head)):
            hits = where.get(row, [])
            if len(hits) != 1:
                why = (
                    f"{len(hits)} original positions hold this exact (key, value) pair"
                    if hits
                    else "the pair is not in the uncompressed cache (the press changed rows, not only chose them)"
                )
                raise PositionsUnrecoverable(f"head {head} slot {j}: {why}; positions cannot be recovered")
            found.append(hits[0])
        slots.append(found)
    index = torch.tensor(slots, dtype=torch.long)  # [Hkv, n_kept]
    gather = index[None, :, :, None].expand(1, -1, -1, k0.shape[3])
    if not (torch.equal(k0.gather(2, gather), k1) and torch.equal(v0.gather(2, gather), v1)):
        raise PositionsUnrecoverable("the recovered positions do not reproduce the compressed cache")
    return index


def record_kept(press, records: dict):
    """Wrap the press's forward hook (an instance attribute shadows the method that __call__ registers): keep the
    layer's uncompressed keys and values, let kvpress compress, then recover which positions stayed."""
    hook = press.forward_hook

    def recording_hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        original = layer.keys
        before = (layer.keys.clone(), layer.values.clone())  # copies: safe even if a press wrote in place
        result = hook(module, args, kwargs, output)
        if layer.keys is not original or layer.keys.shape != before[0].shape:
            records[module.layer_idx] = (int(before[0].shape[2]), kept_slots(before, (layer.keys, layer.values)))
        else:
            records.setdefault(module.layer_idx, (int(before[0].shape[2]), None))
        return result

    press.forward_hook = recording_hook


DECODING_PRESSES = ("knorm", "tova", "streaming_llm")  # the ones our decoding schedules offer


def make_decoding_press(kvpress, name: str, kwargs: dict, decoding: dict):
    """DecodingPress(name's press) with the request's interval and target size, inside a PrefillDecodingPress whose
    prefilling press is name's press at kwargs' compression_ratio when decoding["prefill"]."""
    base = {k: v for k, v in kwargs.items() if k != "compression_ratio"}  # DecodingPress sets the base's ratio
    inner = kvpress.DecodingPress(
        base_press=make_press(kvpress, name, base),
        compression_interval=int(decoding["compression_interval"]),
        target_size=int(decoding["target_size"]),
        **({"hidden_states_buffer_size": int(decoding["buffer"])} if decoding.get("buffer") is not None else {}),
    )
    if not decoding.get("prefill"):
        return inner
    return kvpress.PrefillDecodingPress(prefilling_press=make_press(kvpress, name, kwargs), decoding_press=inner)


def follow_positions(press, current: list, held: dict, events: dict):
    """Wrap the press's forward hook: each layer's slots -> original positions ([Hkv, S], the forward's positions
    `current[0]` appended as attention wrote them), re-mapped through every compression (recovered bit for bit as
    kept_slots does); events[layer] gets (current[1], positions after it) per compression."""
    import torch

    hook = press.forward_hook

    def following_hook(module, args, kwargs, output):
        i = module.layer_idx
        layer = kwargs["past_key_values"].layers[i]
        new = current[0][None].expand(layer.keys.shape[1], -1)  # [Hkv, T]
        held[i] = torch.cat([held[i], new], 1) if i in held else new.clone()
        if held[i].shape[1] != layer.keys.shape[2]:
            raise PositionsUnrecoverable(f"layer {i}: {layer.keys.shape[2]} slots but {held[i].shape[1]} positions")
        original, before = layer.keys, (layer.keys.clone(), layer.values.clone())
        result = hook(module, args, kwargs, output)
        if layer.keys is not original or layer.keys.shape != before[0].shape:
            slots = kept_slots(before, (layer.keys, layer.values))  # [Hkv, n_kept]
            held[i] = held[i].gather(1, slots)
            events.setdefault(i, []).append((current[1], held[i].sort(dim=-1).values))
        return result

    press.forward_hook = following_hook


def run_decoding(request: dict, result_path: str, kvpress, model, meta: dict) -> dict:
    """The decoding-time press: prefill and teacher-forced continuation (one token per forward) under it, then
    optionally a greedy generation under a fresh one."""
    import torch
    from safetensors.torch import save_file
    from transformers import DynamicCache

    name, kwargs, decoding = request["press"], dict(request.get("press_kwargs") or {}), request["decoding"]
    if name not in DECODING_PRESSES:
        known = ", ".join(DECODING_PRESSES)
        return {"error": f"press {name!r} has no decoding check (known: {known})", "kind": "worker"}
    context = torch.tensor([request["context_ids"]], dtype=torch.long)  # [1, T_ctx]
    continuation = torch.tensor([request["continuation_ids"]], dtype=torch.long)  # [1, T_cont]
    t_ctx, t_cont = context.shape[1], continuation.shape[1]
    try:
        press = make_decoding_press(kvpress, name, kwargs, decoding)
    except Exception as e:  # noqa: BLE001 - kvpress refused its arguments
        return {"error": f"reference failed: {type(e).__name__}: {e}", "kind": "reference", "meta": meta}
    meta["press_class"] = type(press).__name__
    meta["decoding"] = decoding
    current, held, events, tensors = [None, -1], {}, {}, {}
    follow_positions(press, current, held, events)
    cache, stage = DynamicCache(), "prefill"
    try:
        started = time.perf_counter()
        with torch.no_grad(), press(model):
            current[:] = [torch.arange(t_ctx), -1]
            first = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits[:, -1]  # [1, V]
            stage, logits = "continuation", []
            for t in range(t_cont):
                current[:] = [torch.tensor([t_ctx + t]), t]
                positions = torch.tensor([[t_ctx + t]])
                out = model(input_ids=continuation[:, t : t + 1], past_key_values=cache, position_ids=positions)
                logits.append(out.logits[:, -1])
        meta["timings"]["prefill_and_continuation_s"] = time.perf_counter() - started
        meta["cache_lengths"] = [int(layer.keys.shape[2]) for layer in cache.layers]
        meta["events"] = {str(i): [step for step, _ in ev] for i, ev in sorted(events.items())}
        for i, positions in sorted(held.items()):
            tensors[f"held.{i}"] = positions.sort(dim=-1).values.contiguous()
        for i, ev in events.items():
            for k, (_, positions) in enumerate(ev):
                tensors[f"event.{i}.{k}"] = positions.contiguous()
        predicting = torch.cat([first[:, None], torch.stack(logits[:-1], 1)], dim=1).float()  # [1, T_cont, V]
        nll = -torch.log_softmax(predicting, dim=-1).gather(-1, continuation[..., None])[0, :, 0]  # [T_cont]
        tensors["nll"] = nll.contiguous()
        meta["mean_nll"] = float(nll.mean())
        greedy = int(request.get("greedy") or 0)
        if greedy:
            stage = "greedy"
            fresh = make_decoding_press(kvpress, name, kwargs, decoding)  # its step counts start again
            tensors["greedy"] = greedy_tokens(model, fresh, context, greedy)
    except PositionsUnrecoverable:
        raise
    except Exception as e:  # noqa: BLE001 - kvpress asserts and raises many kinds
        return _failed(e, stage, meta, tensors, result_path, save_file)
    save_file(tensors, result_path)
    return {"meta": meta}


def greedy_tokens(model, press, context, n: int):
    """[n] int64: the tokens greedy decoding picks after `context`, one per forward under `press` (as kvpress's
    pipeline decodes: position_ids continue from the context, the cache holds fewer slots than positions)."""
    import torch
    from transformers import DynamicCache

    cache, t_ctx, out = DynamicCache(), context.shape[1], []
    with torch.no_grad(), press(model):
        token = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1)  # [1]
        for t in range(n):
            out.append(token)
            if t + 1 < n:
                positions = torch.tensor([[t_ctx + t]])
                logits = model(input_ids=token[:, None], past_key_values=cache, position_ids=positions).logits
                token = logits[:, -1].argmax(-1)
    return torch.cat(out).contiguous()


def run(request: dict, result_path: str) -> dict:
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    try:
        import kvpress
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return {
            "error": f"kvpress is not importable in this interpreter: {type(e).__name__}: {e}",
            "kind": "unavailable",
        }
    transformers.logging.set_verbosity_error()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # its 'model not tested' warning goes to meta instead
    name, kwargs = request["press"], dict(request.get("press_kwargs") or {})
    if name not in PRESSES:
        return {"error": f"unknown press {name!r} (known: {', '.join(PRESSES)})", "kind": "worker"}
    if request.get("dtype", "float32") not in DTYPES:
        return {"error": f"dtype {request.get('dtype')!r} is not one of {DTYPES}", "kind": "worker"}
    feed = request.get("feed", "one_forward")
    if feed not in FEEDS:
        return {"error": f"feed {feed!r} is not one of {FEEDS}", "kind": "worker"}
    attn = request.get("attn_implementation") or ("eager" if PRESSES[name][1] else "sdpa")
    context = torch.tensor([request["context_ids"]], dtype=torch.long)  # [1, T_ctx]
    continuation = torch.tensor([request["continuation_ids"]], dtype=torch.long)  # [1, T_cont]
    t_ctx, t_cont = context.shape[1], continuation.shape[1]
    torch.manual_seed(0)
    torch.set_num_threads(int(request.get("threads") or torch.get_num_threads()))

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(request["checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(
        request["checkpoint"], dtype=getattr(torch, request.get("dtype", "float32")), attn_implementation=attn
    ).eval()
    load_s = time.perf_counter() - started
    meta = {
        "press": name,
        "press_class": None,
        "press_kwargs": kwargs,
        "attn_implementation": attn,
        "dtype": request.get("dtype", "float32"),
        "feed": feed,
        "model_class": type(model).__name__,
        "kvpress_tested_model": isinstance(model, kvpress.presses.base_press.SUPPORTED_MODELS),
        "kvpress_version": getattr(kvpress, "__version__", None) or _version("kvpress"),
        "versions": {
            "kvpress": getattr(kvpress, "__version__", None) or _version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "context_len": t_ctx,
        "continuation_len": t_cont,
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "layer_types": list(getattr(config, "layer_types", None) or []),
        "timings": {"load_s": load_s},
    }

    if request.get("decoding") is not None:
        return run_decoding(request, result_path, kvpress, model, meta)
    tensors, records = {}, {}
    try:
        press = make_press(kvpress, name, kwargs)
    except Exception as e:  # noqa: BLE001 - kvpress refused its arguments
        return {"error": f"reference failed: {type(e).__name__}: {e}", "kind": "reference", "meta": meta}
    meta["press_class"] = type(press).__name__ if press is not None else None
    if press is not None:
        record_kept(press, records)
    cache = DynamicCache()  # as kvpress's pipeline: no config, so every layer (sliding ones too) is a DynamicLayer
    stage = "prefill"
    try:
        started = time.perf_counter()
        with torch.no_grad(), press(model) if press is not None else nullcontext():
            first = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits[:, -1]  # [1, V]
        meta["timings"]["prefill_s"] = time.perf_counter() - started
        meta["cache_layer_classes"] = sorted({type(layer).__name__ for layer in cache.layers})
        meta["cache_lengths"] = [int(layer.keys.shape[2]) for layer in cache.layers]
        _store_kept(records, tensors, meta)
        stage = "continuation"
        started = time.perf_counter()
        positions = torch.arange(t_ctx, t_ctx + t_cont)[None]  # [1, T_cont]: original positions, not cache slots
        with torch.no_grad():
            if feed == "one_forward":  # the pipeline's question forward
                logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits
            else:  # the pipeline's decoding loop, teacher-forced: one token per forward
                logits = torch.cat(
                    [
                        model(
                            input_ids=continuation[:, t : t + 1],
                            past_key_values=cache,
                            position_ids=positions[:, t : t + 1],
                        ).logits
                        for t in range(t_cont)
                    ],
                    dim=1,
                )
            # logits: [1, T_cont, V]
        meta["timings"]["continuation_s"] = time.perf_counter() - started
    except PositionsUnrecoverable:
        raise
    except Exception as e:  # noqa: BLE001 - kvpress asserts and raises many kinds
        return _failed(e, stage, meta, tensors, result_path, save_file)
    # token t of the continuation is predicted by the logit before it: the prefill's last one, then the continuation's
    predicting = torch.cat([first[:, None], logits[:, :-1]], dim=1).float()  # [1, T_cont, V]
    logp = torch.log_softmax(predicting, dim=-1)
    nll = -logp.gather(-1, continuation[..., None])[0, :, 0]  # [T_cont]
    tensors["nll"] = nll.contiguous()
    meta["mean_nll"] = float(nll.mean())
    save_file(tensors, result_path)
    return {"meta": meta}


def _store_kept(records: dict, tensors: dict, meta: dict) -> None:
    meta["hooked_layers"] = sorted(records)
    meta["compressed_layers"] = sorted(
        i for i, (_, slots) in records.items() if slots is not None and slots.shape[1] < records[i][0]
    )
    meta["n_kept"] = {}
    for i, (_, slots) in sorted(records.items()):
        if slots is None:
            continue
        meta["n_kept"][str(i)] = int(slots.shape[1])
        meta.setdefault("slots_sorted", {})[str(i)] = bool((slots[:, 1:] > slots[:, :-1]).all())
        tensors[f"kept.{i}"] = slots.sort(dim=-1).values.contiguous()  # [Hkv, n_kept] ascending
        tensors[f"slots.{i}"] = slots.contiguous()  # [Hkv, n_kept] in cache-slot order (kvpress keeps topk order)


def _failed(error, stage, meta, tensors, result_path, save_file) -> dict:
    if tensors:
        save_file(tensors, result_path)
    one_line = " ".join(str(error).split())[:500]
    return {
        "error": f"reference failed in the {stage}: {type(error).__name__}: {one_line}",
        "kind": "reference",
        "stage": stage,
        "meta": meta,
    }


def _version(package: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(request_path: str, answer_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    started = time.perf_counter()
    answer = run(request, result_path)
    answer.setdefault("meta", {}).setdefault("timings", {})["worker_s"] = time.perf_counter() - started
    Path(answer_path).write_text(json.dumps(answer))


if __name__ == "__main__":
    main(*sys.argv[1:4])

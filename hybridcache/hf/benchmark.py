"""The bridge's cost: a decode step of HF's own modeling code with `cache_for(model)` (native config) against the same
step with HF's own `DynamicCache`, on the same model, prompt and tokens.

Per run: prefill the prompt (not timed), then time each of `steps` one-token forwards (greedy, a third-party loop
holding the cache); the two caches alternate run by run and each reports its median step over all runs, so a busy
machine slows both alike. The ratio is bridge / HF.

    python -m hybridcache.hf.benchmark [--model gemma3_270m|tiny:<model_type>|DIR] [--prompt 128] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def load(name: str):
    import transformers

    from hybridcache.hf.tiny_hf import tiny_model

    if name.startswith("tiny:"):
        return tiny_model(name.removeprefix("tiny:"))
    if name == "gemma3_270m":
        from hybridcache.checkpoints.real import real_checkpoint

        name = str(real_checkpoint("gemma3_270m"))
    return transformers.AutoModelForCausalLM.from_pretrained(Path(name), dtype=torch.float32).eval()


@torch.no_grad()
def decode_steps(model, cache, ids: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each one-token forward after a prefill of `ids` [1, T] into `cache`."""
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, cache=cache)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        t = time.perf_counter()
        out = model(input_ids=token, attention_mask=mask, cache=cache)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t)
    return times


def measure(model, prompt: int, steps: int, runs: int) -> dict[str, float]:
    from transformers import DynamicCache

    from hybridcache.hf import cache_for

    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, min(vocab, 30000), (1, prompt), generator=torch.Generator().manual_seed(0))
    config = model.config.get_text_config(decoder=True)
    makers = {"hf": lambda: DynamicCache(config=config), "bridge": lambda: cache_for(model)}
    for make in makers.values():  # warm-up (the bridge's first call probes and installs)
        decode_steps(model, make(), ids, 2)
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(runs):
        for name, make in makers.items():
            times[name] += decode_steps(model, make(), ids, steps)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"hf_ms": med["hf"], "bridge_ms": med["bridge"], "ratio": med["bridge"] / med["hf"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="gemma3_270m, tiny:<model_type> or a checkpoint directory")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"decode step, median ms over {args.runs} alternating runs x {args.steps} steps, prompt {args.prompt}")
    print(f"{'model':<24} {'HF DynamicCache':>16} {'bridge':>10} {'bridge / HF':>12}")
    for name in args.model or ["gemma3_270m"]:
        r = measure(load(name), args.prompt, args.steps, args.runs)
        print(f"{name:<24} {r['hf_ms']:>16.2f} {r['bridge_ms']:>10.2f} {r['ratio']:>12.3f}")


if __name__ == "__main__":
    main()

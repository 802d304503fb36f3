"""A/B timing of a compiled decode step: the kernel ops traced into the graph (after issue 21) against only the
projection op traced (before: norms, rotary, MLP activation and attention by torch math under torch.compile).

One model, one compiled step: hybridcache.accel.native.kernel_calls.TRACED_OPS selects the graph (torch.compile guards
on it,
so each value keeps its own graph). Runs alternate A / B in one process, so a loaded machine slows both alike;
prints per-step medians and spreads (the first step of each run dropped: a new cache size).

    PYTHONPATH=. python experiments/benchmark/standalone/compiled_ops_ab.py [--model gemma3_270m | --tiny gemma3]
[--runs 8]
[--tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hybridcache as hc
from hybridcache.accel.native import kernel_calls

VARIANTS = {"before": frozenset({"decode_linear"}), "after": frozenset(kernel_calls.TRACED_OPS)}


def load(args) -> hc.models.HybridLM:
    if args.tiny:
        from hybridcache.checkpoints.tiny import tiny_checkpoint

        return hc.from_pretrained(tiny_checkpoint(args.tiny))
    from hybridcache.checkpoints.real import real_checkpoint

    return hc.from_pretrained(real_checkpoint(args.model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3_270m")
    parser.add_argument("--tiny", default=None)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load(args)
    ids = torch.randint(3, 200, (1, 16))
    step = torch.compile(model.forward_block, dynamic=True)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    current = {"name": "after", "run": []}

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = step(*a, **k)
        current["run"].append(time.perf_counter() - t0)
        return out

    model._compiled_decode_step = timed
    sequences = {}
    with torch.no_grad():
        for name, ops in VARIANTS.items():  # compile both graphs
            kernel_calls.TRACED_OPS = ops
            t0 = time.perf_counter()
            sequences[name] = hc.generate(model, ids, max_new_tokens=args.tokens, compile=True).sequences
            print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s (compile)", flush=True)
        for r in range(args.runs):
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                kernel_calls.TRACED_OPS = VARIANTS[name]
                current["run"] = []
                out = hc.generate(model, ids, max_new_tokens=args.tokens, compile=True)
                times[name] += current["run"][1:]
                sequences[name] = out.sequences
    kernel_calls.TRACED_OPS = VARIANTS["after"]
    print(f"same tokens before / after: {torch.equal(sequences['before'], sequences['after'])}")
    for name, ts in times.items():
        ms = sorted(t * 1e3 for t in ts)
        q1, q3, med = ms[len(ms) // 4], ms[3 * len(ms) // 4], statistics.median(ms)
        print(f"{name:6s} median {med:7.2f} ms/step  IQR {q1:.2f}..{q3:.2f}  min {ms[0]:.2f}  n={len(ms)}")
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"after / before (medians): {after / before:.3f}")


if __name__ == "__main__":
    main()

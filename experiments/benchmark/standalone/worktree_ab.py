"""A/B timing of greedy decode between two checkouts of this repository (e.g. `git worktree add /tmp/before <rev>`
and the working tree): one process per measurement, the two sides interleaved round by round in ABBA order (a
loaded machine slows both alike), each process timing `hc.generate` (batch 1) a few times after a warm-up call.
Prints one JSON line per measurement (wall and process CPU time, medians; a hash of the tokens, which must agree),
then a summary per model and side. Models: gemma_f32 / gemma_bf16 (the real Gemma 3 270M, float32 or bfloat16
weights), or any tiny family by name (jamba, ...).

    PYTHONPATH=. python experiments/benchmark/standalone/worktree_ab.py /tmp/before . [--models gemma_f32 jamba]
[--rounds 4] [--reps 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(which: str, reps: int, tokens: int) -> dict:
    """Time `reps` calls of hc.generate for model `which` in this process (the checkout on PYTHONPATH)."""
    import torch

    torch.set_num_threads(1)
    import hybridcache as hc

    if which.startswith("gemma_"):
        from hybridcache.checkpoints.real import real_checkpoint

        weights = None if which == "gemma_f32" else "bfloat16"
        model = hc.from_pretrained(real_checkpoint("gemma3_270m", quiet=True), weights=weights)
        ids = torch.tensor([[2, *range(1000, 1015)]])
    else:
        from hybridcache.checkpoints.tiny import tiny_checkpoint

        model = hc.from_pretrained(tiny_checkpoint(which))
        ids = torch.tensor([[1, *range(10, 25)]])
    hc.generate(model, ids, max_new_tokens=8)  # warm: kernels, bindings
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = hc.generate(model, ids, max_new_tokens=tokens)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "which": which,
        "wall_ms": 1000 * statistics.median(wall),
        "cpu_ms": 1000 * statistics.median(cpu),
        "tokens_hash": hash(tuple(out.sequences[0, -tokens:].tolist())),
        "package": os.path.dirname(os.path.dirname(os.path.abspath(hc.__file__))),  # the checkout that ran
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--models", nargs="+", default=["gemma_f32", "gemma_bf16", "jamba"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one measurement (the child process)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.reps, args.tokens)))
        return
    sides = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    rows = []
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for which in args.models:
            for side in order:
                env = {**os.environ, "PYTHONPATH": sides[side], "OMP_NUM_THREADS": "1"}
                load = os.getloadavg()[0]
                cmd = [sys.executable, __file__, args.before, args.after, "--measure", which]
                cmd += ["--reps", str(args.reps), "--tokens", str(args.tokens)]
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                row = {**json.loads(out.strip().splitlines()[-1]), "side": side, "round": r, "load": load}
                if row["package"] != sides[side]:
                    raise SystemExit(f"the {side} side imported hybridcache from {row['package']}, not {sides[side]}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    for which in args.models:
        for side in sides:
            got = [x for x in rows if x["which"] == which and x["side"] == side]
            wall, cpu = [x["wall_ms"] for x in got], [x["cpu_ms"] for x in got]
            print(
                f"{which} {side}: cpu {statistics.median(cpu):.0f} ms [{min(cpu):.0f}-{max(cpu):.0f}], wall "
                f"{statistics.median(wall):.0f} ms [{min(wall):.0f}-{max(wall):.0f}], tokens agree: "
                f"{len({x['tokens_hash'] for x in rows if x['which'] == which}) == 1}"
            )


if __name__ == "__main__":
    main()

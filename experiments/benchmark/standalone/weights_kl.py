"""What a packed weight format changes: the KL of the next-token distribution to the float32 model's, on the
benchmark's batch-1 prompt (prompt_ids(vocab, 1, 128): the last position, the prompt's first decode step, as the
llama.cpp comparison in docs/benchmarks.md reports it, and the mean over all 128 positions), with the top-1
agreement over the positions, for the real Gemma 3 270M at each weight format.

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/benchmark/standalone/weights_kl.py [--formats bfloat16 int8 q8_0]
"""

from __future__ import annotations

import argparse

import torch

import hybridcache as hc
from experiments.benchmark.main import prompt_ids
from hybridcache.checkpoints.real import real_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", nargs="+", default=["bfloat16", "int8", "q8_0"])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = real_checkpoint("gemma3_270m")
    base = hc.from_pretrained(path)
    ids = prompt_ids(base.vocab_size, 1, args.tokens)
    with torch.no_grad():
        ref = torch.log_softmax(base(ids)[0].double(), -1)  # [T, V]
    del base
    print(f"Gemma 3 270M, the benchmark's batch-1 prompt ({args.tokens} tokens), KL(float32 || format):")
    for fmt in args.formats:
        model = hc.from_pretrained(path, weights=fmt)
        with torch.no_grad():
            got = torch.log_softmax(model(ids)[0].double(), -1)
        kl = (ref.exp() * (ref - got)).sum(-1)  # [T]
        top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean()
        print(
            f"{fmt:9s} last position {kl[-1].item():.2e}, mean over positions {kl.mean().item():.2e}, "
            f"top-1 agreement {top1.item():.1%}",
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()

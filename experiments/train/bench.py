"""Which implementation trains the hybrid faster on this CPU: HF transformers' BambaForCausalLM (its pure-torch
Mamba2 path) or ours (hybridcache.models.families.bamba with autograd, a fresh cache per step). A 2-layer config (M A),
a few AdamW steps each, 1 thread. experiment=train uses the faster one: HF (2026-11-25, 2-core AMD EPYC shared
with other jobs: 1,695 vs 1,395 tok/s at load average 8; 3,483 vs 3,396 at load average 3).

    python -m experiments.train.bench [--steps 4] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from experiments.train.model import hf_config, hf_model

SIZE = dict(
    hidden=256,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=64,
    intermediate=768,
    attention_every=2,
    mamba_heads=8,
    state=64,
    chunk=64,
    max_positions=1024,
)


def tokens_per_s(forward, params, ids: torch.Tensor, steps: int) -> float:
    """Training tokens/s over `steps` AdamW steps after one warm-up step."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        logits = forward(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * ids[:, :-1].numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hybridcache.models.families.bamba import BambaLM

    ids = torch.randint(3, 259, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    hf = hf_model("hybrid", SIZE, seed=0)
    ours = BambaLM(hf_config("hybrid", SIZE).to_dict()).float().train()
    ours.load_state_dict(hf.state_dict())  # the same weights (our names follow HF's)
    print(f"HF BambaForCausalLM: {tokens_per_s(lambda x: hf(x).logits, hf.parameters(), ids, args.steps):.0f} tok/s")
    print(f"ours (autograd):     {tokens_per_s(lambda x: ours(x), ours.parameters(), ids, args.steps):.0f} tok/s")


if __name__ == "__main__":
    main()

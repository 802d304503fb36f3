"""Peak resident memory of one long prompt through our model path on the real Gemma 3 270M, prefilled as one block,
then 4 greedy tokens: `python -m experiments.long_context.peak_rss TOKENS {native,snapkv_50}` prints one JSON line
(peak RSS from resource.getrusage, the RSS before generation, seconds, the new tokens)."""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

CONFIGS = {
    "native": None,
    "snapkv_50": {"attention": {"type": "snapkv", "compression_ratio": 0.5, "window_size": 64, "schedule": "prefill"}},
}


def main(argv: list[str]) -> None:
    import hybridcache as hc
    from hybridcache.checkpoints.real import real_checkpoint

    torch.set_num_threads(1)
    tokens, which = int(argv[0]), argv[1]
    model = hc.from_pretrained(real_checkpoint("gemma3_270m"), dtype=torch.float32)
    ids = torch.randint(3, 20000, (1, tokens), generator=torch.Generator().manual_seed(0))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t = time.perf_counter()
    out = hc.generate(model, ids, torch.ones_like(ids), 4, cache_config=CONFIGS[which], output_logits=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "tokens": tokens,
                "config": which,
                "peak_rss_gb": round(peak / 1e6, 2),
                "rss_before_gb": round(before / 1e6, 2),
                "seconds": round(time.perf_counter() - t, 1),
                "new": out.sequences[0, tokens:].tolist(),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])

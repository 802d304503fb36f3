"""One long-context measurement in a fresh process (so peak RSS is its own): prefill L tokens in chunks, decode N.

    python -m experiments.long_context_probe CHECKPOINT '{"attention": ...}' TOKENS DECODE CHUNK
prints one JSON line: prefill seconds, ms per decode token, peak RSS, cache bytes held.
"""

import json
import resource
import sys
import time
from pathlib import Path

import torch

import hybridcache as hc
from hybridcache.generation import greedy_next


def peak_rss_kib() -> float:
    """This process's peak resident memory (KiB). VmHWM belongs to the process's own address space; getrusage's
    ru_maxrss would also count the parent's peak at fork time, which Linux carries across exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    except OSError:
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main(checkpoint: str, cache_config: str, tokens: int, decode: int, chunk: int) -> dict:
    torch.manual_seed(0)
    model = hc.from_pretrained(checkpoint)
    config = json.loads(cache_config) or None
    ids = torch.randint(3, model.vocab_size, (1, tokens))
    rss_loaded = peak_rss_kib()
    cache = model.make_cache(1, config)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, tokens, chunk):  # the head for the last position only (as generate's prefill)
            logits = model.run_block(ids[:, i : i + chunk], cache, last_only=True)
    prefill = time.perf_counter() - start
    token = greedy_next(logits[:, -1])[:, None]  # [B, 1]
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(decode):
            token = greedy_next(model.run_block(token, cache)[:, -1])[:, None]  # one decode step, no input checks
    per_token = (time.perf_counter() - start) / decode
    rss = peak_rss_kib()
    return {
        "tokens": tokens,
        "prefill_s": prefill,
        "decode_ms_per_token": per_token * 1e3,
        "peak_rss_mib": rss / 1024,
        "loaded_rss_mib": rss_loaded / 1024,
        "cache_bytes": cache.nbytes(),
    }


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]))))

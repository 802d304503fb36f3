"""Long-context measurements in a fresh process (so peak RSS is its own).

    python -m experiments.long_context.probe CHECKPOINT '{"attention": ...}' TOKENS DECODE CHUNK
prefills TOKENS random tokens in chunks and decodes DECODE; prints one JSON line: prefill seconds, ms per decode
token, peak RSS, cache bytes held (experiment=benchmark).

    python -m experiments.long_context.probe --job JOB.json
answers a group of prompts (experiment=long_context: one cache config, one prompt length) greedily, each prefilled
in chunks of `chunk` tokens; prints one JSON line per prompt as it finishes (its new tokens, seconds), then one with
the process's peak RSS. The job: {checkpoint, dtype, device, weights, config, chunk, threads, prompts: [{ids,
max_new_tokens}]}.
"""

import json
import resource
import sys
import time
from pathlib import Path

import torch

import hybridcache as hc
from hybridcache.generation.loop import greedy_next


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
            logits = model.feed_block(ids[:, i : i + chunk], cache, last_only=True)
    prefill = time.perf_counter() - start
    token = greedy_next(logits[:, -1])[:, None]  # [B, 1]
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(decode):
            token = greedy_next(model.feed_block(token, cache)[:, -1])[:, None]  # one decode step, no input checks
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


def run_job(job: dict) -> None:
    """Each prompt of the job under its cache config, one JSON line each, then the peak RSS line (see above)."""
    torch.set_num_threads(int(job.get("threads") or 1))
    model = hc.from_pretrained(
        job["checkpoint"],
        dtype=getattr(torch, job.get("dtype") or "float32"),
        device=job.get("device") or "cpu",
        weights=job.get("weights"),
    )
    print(json.dumps({"loaded_rss_mib": peak_rss_kib() / 1024}), flush=True)
    for prompt in job["prompts"]:
        ids = torch.tensor([prompt["ids"]], device=model.device)  # [1, L]
        chunk = int(job["chunk"]) or ids.shape[1]  # 0: the whole prompt in one block
        start = time.perf_counter()
        with torch.no_grad():
            out = hc.generate(
                model,
                ids,
                max_new_tokens=int(prompt["max_new_tokens"]),
                cache_config=job["config"] or None,
                prefill_chunk_size=chunk,
                output_logits=False,
            )
        seconds = time.perf_counter() - start
        new = out.sequences[0, ids.shape[1] :].tolist()
        print(json.dumps({"tokens": new, "seconds": seconds, "cache_bytes": out.cache.nbytes()}), flush=True)
    print(json.dumps({"peak_rss_mib": peak_rss_kib() / 1024}), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[:1] == ["--job"]:
        run_job(json.loads(Path(a[1]).read_text()))
    else:
        print(json.dumps(main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]))))

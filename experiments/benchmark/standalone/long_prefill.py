"""Long prefill on the real Gemma 3 270M: ours, HF transformers and llama.cpp on the same 4k-16k-token prompt.

    python -m experiments.benchmark.standalone.long_prefill [--lengths 4096 8192 16384] [--chunk 512] [--threads 2]
        [--precisions f32 bf16 q8_0] [--systems ours hf llamacpp] [--out FILE.json]

Every (system, precision, length) runs in a fresh process, so its peak RSS (VmHWM, weights included) is its own:
ours prefills in `chunk`-token blocks through `feed_block` (the head for the last position only), HF through its
DynamicCache in the same blocks (`logits_to_keep=1`), llama.cpp evaluates the prompt with `n_batch=chunk` (its
worker, reference/llamacpp_worker.py, in $HYBRIDCACHE_LLAMACPP_PYTHON's environment). Each reports wall and process
CPU seconds and its first greedy token (the three agree where their weights do: f32 and bf16 come from the same
Q4_K_M GGUF). Precisions: f32 (float32 everywhere), bf16 (our bfloat16-packed weights with float32 activations, HF
in bfloat16, llama.cpp bf16), q8_0 (our int8 weights, llama.cpp q8_0; HF has no counterpart).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SYSTEMS = ("ours", "hf", "llamacpp")
PRECISIONS = ("f32", "bf16", "q8_0")
# ours: (activation dtype, packed weights); HF: its dtype (None: no counterpart)
OURS = {"f32": ("float32", None), "bf16": ("float32", "bfloat16"), "q8_0": ("float32", "int8")}
HF = {"f32": "float32", "bf16": "bfloat16", "q8_0": None}


class LongPrefillError(ValueError):
    """A setting the benchmark refuses before it starts (unknown system or precision, lengths out of range)."""


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list[int]:
    """A reproducible prompt of `length` ordinary token ids (no special ids below 3)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def _peak_rss_mib() -> float:
    from experiments.long_context.probe import peak_rss_kib

    return peak_rss_kib() / 1024


def run_ours(job: dict) -> dict:
    import torch

    import hybridcache as hc

    torch.set_num_threads(job["threads"])
    dtype, weights = OURS[job["precision"]]
    model = hc.from_pretrained(job["checkpoint"], dtype=getattr(torch, dtype), weights=weights)
    ids = torch.tensor([job["prompt"]])  # [1, L]
    loaded = _peak_rss_mib()
    cache = model.make_cache(1)
    wall, busy = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(0, ids.shape[1], job["chunk"]):
            logits = model.feed_block(ids[:, i : i + job["chunk"]], cache, last_only=True)
    first = int(logits[0, -1].argmax())
    wall, busy = time.perf_counter() - wall, time.process_time() - busy
    return {"prefill_s": wall, "cpu_s": busy, "first_token": first, "loaded_rss_mib": loaded}


def run_hf(job: dict, model=None) -> dict:
    """HF's chunked prefill (`model`: an already loaded one, else the job's checkpoint at its precision)."""
    import torch
    import transformers

    torch.set_num_threads(job["threads"])
    if model is None:
        dtype = getattr(torch, HF[job["precision"]])
        model = transformers.AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=dtype).eval()
    ids = torch.tensor([job["prompt"]])  # [1, L]
    loaded = _peak_rss_mib()
    cache = transformers.DynamicCache(config=model.config)
    wall, busy = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(0, ids.shape[1], job["chunk"]):
            block = ids[:, i : i + job["chunk"]]
            positions = torch.arange(i, i + block.shape[1])[None]
            out = model(input_ids=block, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=1)
    first = int(out.logits[0, -1].argmax())
    wall, busy = time.perf_counter() - wall, time.process_time() - busy
    return {"prefill_s": wall, "cpu_s": busy, "first_token": first, "loaded_rss_mib": loaded}


def worker(job_path: str) -> None:
    """One (system, precision, length) in this process; prints one JSON line with its peak RSS."""
    job = json.loads(Path(job_path).read_text())
    result = (run_ours if job["system"] == "ours" else run_hf)(job)
    print(json.dumps({**result, "peak_rss_mib": _peak_rss_mib()}), flush=True)


def measure(system: str, precision: str, prompt: list[int], args, checkpoint: str, tmp: Path) -> dict:
    if system == "llamacpp":
        from hybridcache.reference.llamacpp_runner import LlamaCppRunner, gemma3_270m_gguf

        cache_dir = Path(os.environ.get("HYBRIDCACHE_HOME", "~/.cache/hybridcache")).expanduser() / "llamacpp"
        gguf, sha = gemma3_270m_gguf(cache_dir)
        runner = LlamaCppRunner(None, gguf, cache_dir, sha, timeout=3600)
        (res,) = runner.time_long_prefill(prompt, args.chunk, args.threads, precisions=[precision])
        return {**res, "version": runner.version}
    job = {"system": system, "precision": precision, "prompt": prompt, "chunk": args.chunk, "threads": args.threads}
    job["checkpoint"] = checkpoint
    path = tmp / f"{system}-{precision}-{len(prompt)}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "experiments.benchmark.standalone.long_prefill", "--worker", str(path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{system} {precision} at {len(prompt)} tokens failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = [
        "| precision | tokens | system | prefill s | tok/s | CPU s | CPU tok/s | peak RSS MiB | first token | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['tokens']} | {r['system']} | {r['prefill_s']:.1f} | "
            f"{r['tokens'] / r['prefill_s']:.0f} | {r['cpu_s']:.1f} | {r['tokens'] / r['cpu_s']:.0f} | "
            f"{r['peak_rss_mib']:.0f} | {r['first_token']} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", nargs="+", default=["f32"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if bad := [s for s in args.systems if s not in SYSTEMS]:
        raise LongPrefillError(f"--systems: unknown {bad}; choose from {list(SYSTEMS)}")
    if bad := [s for s in args.precisions if s not in PRECISIONS]:
        raise LongPrefillError(f"--precisions: unknown {bad}; choose from {list(PRECISIONS)}")
    if any(n < 1 or n > 32768 for n in args.lengths):
        raise LongPrefillError("--lengths: each in [1, 32768] (Gemma 3 270M's context)")
    if not 1 <= args.chunk <= 32768 or not 1 <= args.threads <= 256:
        raise LongPrefillError("--chunk in [1, 32768] and --threads in [1, 256]")
    return args


def main(argv: list[str]) -> None:
    import tempfile

    from hybridcache.checkpoints.real import real_checkpoint

    args = parse(argv)
    checkpoint = str(real_checkpoint("gemma3_270m", quiet=True))
    vocab = json.loads((Path(checkpoint) / "config.json").read_text()).get("vocab_size", 262144)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            for length in args.lengths:
                prompt = prompt_ids(length, vocab)
                for system in args.systems:
                    if system == "hf" and HF[precision] is None:
                        continue
                    load = os.getloadavg()[0]
                    res = measure(system, precision, prompt, args, checkpoint, Path(tmp))
                    row = {"system": system, "precision": precision, "tokens": length, "load": load, **res}
                    rows.append(row)
                    print(
                        f"{precision} {length} {system}: {row['prefill_s']:.1f} s, {length / row['prefill_s']:.0f} "
                        f"tok/s, peak {row['peak_rss_mib']:.0f} MiB (load {load:.1f})",
                        flush=True,
                    )
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        try:
            main(sys.argv[1:])
        except LongPrefillError as e:
            sys.exit(f"error: {e}")

"""Runs inside the llama.cpp environment (llama-cpp-python): reads a JSON request, writes a JSON answer. Imports only
llama_cpp and the standard library (no sibling module may be named llama_cpp: this file's folder is first on sys.path).

    python llamacpp_worker.py request.json answer.json

Per precision: the source GGUF requantized by llama.cpp itself (`llama_model_quantize`, allow_requantize) into
`cache_dir` (atomic write; reused while its recorded digests match), loaded with the benchmark's threads, then timed
like ours: prefill = evaluating the prompt and picking the first token (greedy), decode = the other new - 1 greedy
steps, each phase timed on its own in every repeat, after one untimed warm-up run. With `batch_prompts` (B rows of
one length), the same again for B sequences decoded together (llama.cpp's batch API: one context holding B sequences,
every prompt in one llama_decode call, then one call per step for all B). With `"mode": "long_prefill"`: one long
prompt evaluated once in batches of `chunk` tokens (wall and process CPU seconds, the first greedy token, this
process's peak RSS), the llama.cpp column of experiments/benchmark/standalone/long_prefill.py.
"""

import ctypes
import hashlib
import json
import os
import sys
import time

FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def requantize(
    lib, source: str, source_sha: str, precision: str, cache_dir: str, threads: int, byref=ctypes.byref
) -> str:
    """`cache_dir/<source sha[:16]>-<precision>.gguf`, made by llama.cpp from `source` unless a copy whose sidecar
    records this source, precision and llama.cpp version, and whose own digest still matches, is there."""
    if precision not in FTYPES:
        raise ValueError(f"precision {precision!r}: llama.cpp reference knows {sorted(FTYPES)}")
    os.makedirs(cache_dir, exist_ok=True)
    out = os.path.join(cache_dir, f"{source_sha[:16]}-{precision}.gguf")
    meta_path = out + ".json"
    want = {"source_sha256": source_sha, "precision": precision, "llama_cpp": getattr(lib, "__version__", "?")}
    if os.path.exists(out) and os.path.exists(meta_path):
        try:
            meta = json.load(open(meta_path))
        except ValueError:
            meta = {}
        if all(meta.get(k) == v for k, v in want.items()) and meta.get("sha256") == sha256(out):
            return out
    tmp = f"{out}.tmp{os.getpid()}"
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, FTYPES[precision])
    params.allow_requantize = True  # the source is Q4_K_M: dequantized, then written at `precision`
    params.nthread = threads
    try:
        code = lib.llama_model_quantize(source.encode(), tmp.encode(), byref(params))
        if code != 0:
            raise RuntimeError(f"llama_model_quantize to {precision} returned {code}")
        meta = {**want, "sha256": sha256(tmp)}
        os.replace(tmp, out)  # atomic: a reader sees the old file or the whole new one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".tmp", meta_path)
    return out


def run_once(llm, sampler, sample, prompt: list, n: int, clock) -> tuple[float, float, list]:
    """(prefill s, decode s, the n greedy tokens) of one generation from an empty context."""
    llm.reset()
    start = clock()
    llm.eval(prompt)
    token = sample(sampler, llm._ctx.ctx, -1)
    first = clock()
    tokens = [token]
    for _ in range(n - 1):
        llm.eval([token])
        token = sample(sampler, llm._ctx.ctx, -1)
        tokens.append(token)
    end = clock()
    return first - start, end - first, tokens


def _without_extra_buffers(lib) -> None:
    """Load models without llama.cpp's extra buffer types (AMX / repacked weight layouts): Llama() takes its model
    parameters from llama_model_default_params, so that is where the flag goes."""
    low = lib.llama_cpp  # the module Llama() reads its defaults from
    default = getattr(low, "_hybridcache_default_params", low.llama_model_default_params)

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low._hybridcache_default_params = default
    low.llama_model_default_params = params


def load(lib, model_path: str, request: dict, n_ctx: int, n_batch: int):
    """The model as llama.cpp runs it here: the request's threads for both phases, logits of the last position only,
    without the extra buffer types where the request says so."""
    if not request.get("extra_buffers", True):
        _without_extra_buffers(lib)
    threads = int(request["threads"])
    return lib.Llama(
        model_path=model_path,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )


def time_precision(lib, model_path: str, request: dict, clock=time.perf_counter) -> dict:
    """Prefill and decode samples of `repeats` runs (after one warm-up) and the greedy tokens; refuses runs whose
    tokens differ (the same greedy generation must give the same tokens)."""
    prompt, n = list(request["prompt"]), int(request["new_tokens"])
    llm = load(lib, model_path, request, len(prompt) + n + 8, max(512, len(prompt)))  # the prompt in one batch
    sampler = lib.llama_sampler_init_greedy()
    try:
        _, _, tokens = run_once(llm, sampler, lib.llama_sampler_sample, prompt, n, clock)  # warm-up
        prefill, decode = [], []
        for r in range(max(int(request["repeats"]), 1)):
            p, d, again = run_once(llm, sampler, lib.llama_sampler_sample, prompt, n, clock)
            if again != tokens:
                raise RuntimeError(f"llama.cpp repeat {r}: greedy tokens differ from the warm-up's")
            prefill.append(p)
            decode.append(d)
        batched = time_batched(lib, llm, request, clock) if request.get("batch_prompts") else None
    finally:
        lib.llama_sampler_free(sampler)
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return {"prefill_samples": prefill, "decode_samples": decode, "tokens": tokens, "batched": batched}


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (VmHWM, MiB; None where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def time_long_prefill(lib, model_path: str, request: dict, clock=time.perf_counter, cpu=time.process_time) -> dict:
    """One evaluation of a long prompt in batches of `chunk` tokens (llama.cpp splits it itself), timed by the wall
    and this process's CPU clock, then the first greedy token; the peak RSS includes the loaded weights."""
    prompt = list(request["prompt"])
    llm = load(lib, model_path, request, len(prompt) + 8, int(request["chunk"]))
    sampler = lib.llama_sampler_init_greedy()
    try:
        loaded = peak_rss_mib()
        wall, busy = clock(), cpu()
        llm.eval(prompt)
        first = lib.llama_sampler_sample(sampler, llm._ctx.ctx, -1)
        wall, busy = clock() - wall, cpu() - busy
    finally:
        lib.llama_sampler_free(sampler)
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return {
        "prefill_s": wall,
        "cpu_s": busy,
        "first_token": first,
        "loaded_rss_mib": loaded,
        "peak_rss_mib": peak_rss_mib(),
    }


def _fill(batch, entries: list) -> None:
    """Writes (token, position, sequence, wants logits) entries into a llama_batch."""
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, wants) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, int(wants)
        batch.seq_id[i][0] = seq


def batched_once(lib, ctx, batch, sampler, prompts: list, n: int, clock) -> tuple[float, float, list]:
    """(prefill s, decode s, the n greedy tokens of each row) of one batched generation from empty sequences."""
    rows, length = len(prompts), len(prompts[0])
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    start = clock()
    _fill(batch, [(t, p, s, p == length - 1) for s, row in enumerate(prompts) for p, t in enumerate(row)])
    if lib.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed on the batched prompt")
    tokens = [[lib.llama_sampler_sample(sampler, ctx, s * length + length - 1)] for s in range(rows)]
    first = clock()
    for step in range(n - 1):
        _fill(batch, [(tokens[s][-1], length + step, s, True) for s in range(rows)])
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed at batched decode step {step}")
        for s in range(rows):
            tokens[s].append(lib.llama_sampler_sample(sampler, ctx, s))
    end = clock()
    return first - start, end - first, tokens


def time_batched(lib, llm, request: dict, clock=time.perf_counter) -> dict:
    """Like time_precision, for the B prompts of `batch_prompts` decoded together (a context of B sequences)."""
    prompts = [list(r) for r in request["batch_prompts"]]  # checked by serve
    n, threads = int(request["new_tokens"]), int(request["threads"])
    rows, length = len(prompts), len(prompts[0])
    params = lib.llama_context_default_params()
    params.n_ctx = rows * (length + n + 8)
    params.n_batch = params.n_ubatch = max(512, rows * length)  # every prompt in one batch, as ours
    params.n_seq_max = rows
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context for {rows} sequences")
    batch = lib.llama_batch_init(rows * length, 0, 1)
    sampler = lib.llama_sampler_init_greedy()
    try:
        _, _, tokens = batched_once(lib, ctx, batch, sampler, prompts, n, clock)  # warm-up
        prefill, decode = [], []
        for r in range(max(int(request["repeats"]), 1)):
            p, d, again = batched_once(lib, ctx, batch, sampler, prompts, n, clock)
            if again != tokens:
                raise RuntimeError(f"llama.cpp batched repeat {r}: greedy tokens differ from the warm-up's")
            prefill.append(p)
            decode.append(d)
    finally:
        lib.llama_sampler_free(sampler)
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    return {"batch": rows, "prefill_samples": prefill, "decode_samples": decode, "tokens": tokens}


def serve(lib, request: dict, clock=time.perf_counter, byref=ctypes.byref) -> dict:
    """The answer to one request: {"version", "results": [{"precision", "model", ..., samples, tokens}]}."""
    batch = request.get("batch_prompts")
    if batch is not None and (not batch or not batch[0] or len({len(r) for r in batch}) != 1):
        raise ValueError("batch_prompts: B non-empty rows of one length")  # before any file is made or loaded
    source = request["gguf"]
    source_sha = request.get("gguf_sha256") or sha256(source)
    results = []
    for precision in request["precisions"]:
        started = clock()
        path = requantize(lib, source, source_sha, precision, request["cache_dir"], int(request["threads"]), byref)
        prepared = clock() - started
        timed = time_long_prefill if request.get("mode") == "long_prefill" else time_precision
        results.append(
            {"precision": precision, "model": path, "prepare_s": prepared, **timed(lib, path, request, clock)}
        )
    return {"version": getattr(lib, "__version__", "?"), "results": results}


def main(request_path: str, answer_path: str) -> None:
    request = json.load(open(request_path))
    try:
        import llama_cpp
    except ImportError as e:
        answer = {"error": f"llama_cpp is not importable in this interpreter: {e}"}
    else:
        answer = serve(llama_cpp, request)
    with open(answer_path + ".tmp", "w") as f:
        json.dump(answer, f)
    os.replace(answer_path + ".tmp", answer_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

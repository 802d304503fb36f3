"""Runs inside a separate vLLM environment: reads a JSON request, writes a JSON answer. Imports only vllm
(no sibling module may be named vllm: this file's folder is first on sys.path).

    python vllm_worker.py request.json answer.json
"""

import json
import sys
import time

MAMBA1 = {"MambaForCausalLM", "JambaForCausalLM", "FalconMambaForCausalLM"}


def main(request_path: str, answer_path: str) -> None:
    request = json.load(open(request_path))
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform
    except ImportError as e:
        json.dump({"error": f"vllm is not importable in this interpreter: {e}"}, open(answer_path, "w"))
        return
    arch = request.get("architectures") or []
    if current_platform.is_cpu() and MAMBA1 & set(arch):
        json.dump(
            {
                "error": f"vLLM on CPU has no Mamba1 kernel, so it cannot run {', '.join(arch)}; "
                "use a GPU vLLM environment or reference=hf"
            },
            open(answer_path, "w"),
        )
        return
    started = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "float32"),
        skip_tokenizer_init=True,
        max_model_len=request["max_model_len"],
        enforce_eager=True,
        seed=0,
        **request.get("engine_args", {}),
    )
    engine_seconds = time.perf_counter() - started
    if request.get("timing"):  # the benchmark: prefill and decode times per batch, one engine for all of them
        json.dump(
            {"timings": timings(llm, request, SamplingParams, TokensPrompt), "engine_seconds": engine_seconds},
            open(answer_path, "w"),
        )
        return
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        logprobs=request["top_k"],
        detokenize=False,
        stop_token_ids=request.get("stop_token_ids") or None,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    results = []
    for prompt, out in zip(request["prompts"], outputs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        steps = completion.logprobs or []
        top = [{str(t): lp.logprob for t, lp in step.items()} for step in steps]
        chosen = [step[t].logprob for t, step in zip(tokens, steps)]
        results.append(
            {
                "prompt": prompt,
                "tokens": tokens,
                "token_logprobs": chosen,
                "top_logprobs": top,
                "seconds": seconds / len(prompts),
            }
        )
    json.dump(
        {"results": results, "engine_seconds": engine_seconds, "generate_seconds": seconds}, open(answer_path, "w")
    )


def timings(llm, request, SamplingParams, TokensPrompt, clock=time.perf_counter) -> list:
    """Per batch, prefill and decode seconds of every repeat, each phase timed on its own (nothing subtracted): one
    warm-up run, then `repeats` runs of `phases`. eos ignored so every run decodes exactly N tokens."""
    n = int(request["max_new_tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    out = []
    for b, run in enumerate(request["timing"]):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in run["prompts"]]
        phases(llm.llm_engine, prompts, params, n, f"warmup{b}", clock)
        runs = [phases(llm.llm_engine, prompts, params, n, f"b{b}r{r}", clock) for r in range(int(request["repeats"]))]
        out.append(
            {"batch": len(prompts), "prefill_samples": [p for p, _ in runs], "decode_samples": [d for _, d in runs]}
        )
    return out


def phases(engine, prompts, params, n: int, tag: str, clock) -> tuple[float, float]:
    """(prefill, decode) seconds of one batch, stepping vLLM's engine as `LLM.generate` does: prefill from adding the
    requests to the step after which every request has its first token; decode from there to the step that finishes
    them all (the other n - 1 tokens). Refuses a run that did not produce exactly n tokens per request."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    produced: dict[str, int] = {}
    start = clock()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
        if first is None and len(produced) == len(ids) and min(produced.values()) >= 1:
            first = clock()
    end = clock()
    if first is None or sorted(produced) != sorted(ids) or set(produced.values()) != {n}:
        raise RuntimeError(
            f"vLLM timing run {tag}: expected {n} tokens for each of {len(ids)} requests, got {produced}"
        )
    return first - start, end - first


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

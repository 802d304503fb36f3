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


def timings(llm, request, SamplingParams, TokensPrompt) -> list:
    """Per batch: a 1-token generation (prefill) and an N-token one back to back, medians over repeats after one
    warm-up pair; eos ignored so every run decodes exactly N tokens."""

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    out = []
    for run in request["timing"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in run["prompts"]]
        n = request["max_new_tokens"]
        llm.generate(prompts, params(1), use_tqdm=False)
        llm.generate(prompts, params(n), use_tqdm=False)
        pairs = []
        for _ in range(int(request.get("repeats", 1))):
            start = time.perf_counter()
            llm.generate(prompts, params(1), use_tqdm=False)
            middle = time.perf_counter()
            llm.generate(prompts, params(n), use_tqdm=False)
            pairs.append((middle - start, time.perf_counter() - middle))
        pairs.sort(key=lambda p: p[1] - p[0])
        prefill, total = pairs[len(pairs) // 2]
        out.append({"batch": len(prompts), "prefill_s": prefill, "total_s": total})
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

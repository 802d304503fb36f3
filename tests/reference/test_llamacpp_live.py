"""Live: llama.cpp (HYBRIDCACHE_LLAMACPP_PYTHON, an environment with llama-cpp-python) on the real Gemma 3 270M GGUF
requantized to q8_0 and f32, against ours from the same GGUF. Opt-in: skipped unless that variable is set (CI never
builds llama-cpp-python; its source build takes 20-60 min)."""

import os

import pytest
import torch

from hybridcache.checkpoints.real import missing_packages

pytestmark = pytest.mark.skipif(
    not os.environ.get("HYBRIDCACHE_LLAMACPP_PYTHON"), reason="HYBRIDCACHE_LLAMACPP_PYTHON is not set (opt-in)"
)


def test_llamacpp_times_the_real_gguf_and_agrees_with_ours_in_float32(tmp_path):
    if missing_packages("gemma3_270m"):
        pytest.skip(f"the real checkpoint needs {missing_packages('gemma3_270m')}")
    import hybridcache as hc
    from hybridcache.checkpoints.real import real_checkpoint
    from hybridcache.reference.llamacpp_runner import LlamaCppRunner, gemma3_270m_gguf
    from hybridcache.util.paths import home_dir

    cache = home_dir("llamacpp")
    gguf, sha = gemma3_270m_gguf(cache)
    runner = LlamaCppRunner(None, gguf, cache, sha, timeout=1200)
    prompt = torch.randint(3, 262144, (1, 16), generator=torch.Generator().manual_seed(0))
    rows = torch.randint(3, 262144, (2, 16), generator=torch.Generator().manual_seed(2))
    results = runner.time_generation(
        prompt[0].tolist(), 8, 2, 3, precisions=("f32", "q8_0"), batch_prompts=rows.tolist()
    )
    assert [r["precision"] for r in results] == ["f32", "q8_0"]
    for r in results:
        assert len(r["prefill_samples"]) == len(r["decode_samples"]) == 3
        assert all(s > 0 for s in r["prefill_samples"] + r["decode_samples"])
        assert len(r["tokens"]) == 8
        assert r["batched"]["batch"] == 2 and [len(t) for t in r["batched"]["tokens"]] == [8, 8]
    model = hc.from_pretrained(str(real_checkpoint("gemma3_270m")), dtype=torch.float32)
    ours = hc.generate(model, prompt, max_new_tokens=8, output_logits=False).sequences[0, 16:].tolist()
    # the same dequantized weights in float32: an independent engine must pick the same greedy tokens
    assert results[0]["tokens"] == ours
    batched = hc.generate(model, rows, max_new_tokens=8, output_logits=False).sequences[:, 16:].tolist()
    assert results[0]["batched"]["tokens"] == batched  # two sequences decoded together in one llama.cpp context

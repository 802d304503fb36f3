"""hf_quantized against HF transformers 5.2's QuantizedCache (quanto), live, in its own environment
(`HYBRIDCACHE_HFQ_PYTHON`; skipped without it): identical keys and values after every block, for 2 and 4 bits,
axis 0 and -1, splits that cross several flushes. `python -m tests.reference.test_hf_quantized_live --record`
rewrites the recording that tests/cache/test_hf_quantized.py checks without that environment."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from hybridcache.cache.hf_quantized_storage import HFQuantizedStorage
from hybridcache.reference.hf_quantized_runner import run_hf_quantized
from tests.cache.test_hf_quantized import CASES, RECORDED, SPLITS, feed, inputs

pytestmark = pytest.mark.skipif(not os.environ.get("HYBRIDCACHE_HFQ_PYTHON"),
                                reason="HYBRIDCACHE_HFQ_PYTHON is unset (a python with transformers 5.2 + "
                                       "optimum-quanto; see hybridcache/reference/hf_quantized_runner.py)")

LIVE_SPLITS = {  # (B, H, N, D) and block lengths: prefill, decode steps, longer blocks
    "decode": ((2, 2, 40, 16), [9] + [1] * 31),
    "mixed": ((1, 2, 40, 16), [15, 3, 1, 1, 5, 1, 1, 1, 4, 1, 1, 1, 1, 2, 1, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split", list(LIVE_SPLITS))
def test_identical_to_live_hf_5_2(case, split):
    shape, splits = LIVE_SPLITS[split]
    g = torch.Generator().manual_seed(len(case) + len(splits))
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k[..., 2] *= 30.0  # an outlier channel
    config = CASES[case]
    want = run_hf_quantized(k, v, splits, **config)
    got = feed(HFQuantizedStorage(shape[0], shape[1], shape[3], torch.float32, **config), k, v, splits)
    for i, ((keys, values), (ref_k, ref_v)) in enumerate(zip(got, want)):
        assert torch.equal(keys, ref_k), (case, i, (keys - ref_k).abs().max())
        assert torch.equal(values, ref_v), (case, i, (values - ref_v).abs().max())


def record() -> None:
    k, v = inputs()
    out = {"inputs.keys": k, "inputs.values": v}
    for case, config in CASES.items():
        for i, (keys, values) in enumerate(run_hf_quantized(k, v, SPLITS, **config)):
            out[f"{case}.keys.{i}"], out[f"{case}.values.{i}"] = keys, values
    RECORDED.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, RECORDED, metadata={"transformers": "5.2", "splits": str(SPLITS)})


if __name__ == "__main__" and "--record" in sys.argv:
    record()

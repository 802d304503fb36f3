"""hf_quantized against HF transformers 5.2's QuantizedCache (quanto), live, in its own environment
(`HYBRIDCACHE_HFQ_PYTHON`; skipped without it): identical keys and values after every block, for 2 and 4 bits,
axis 0 and -1, splits that cross several flushes. `python -m tests.reference.test_hf_quantized_live --record`
rewrites the recording that tests/cache/test_hf_quantized.py checks without that environment.

On the real model (Gemma 3 270M, float32, skipped without its converted checkpoint): `storage: hf_quantized` in our
model against HF 5.2's model with QuantizedCache(quanto) — the 400-token pydoc prompt prefilled, then a 64-token
continuation in one forward, teacher-forced. HF 5.2 puts a QuantizedLayer on every layer, sliding ones included;
ours keeps the sliding pattern, and 464 tokens < Gemma 3's window of 512, so nothing leaves it. Not bit-exact: the
two models' float32 keys differ by ~1e-6 (their native logits by ~3e-5), which moves a few codes across a rounding
boundary. Measured (HF 5.2.0 / ours): native NLL 2.75203 / 2.75203; 4 bits 2.99385 / 2.99386, max |d logit| 0.0044;
2 bits 6.08399 / 6.08391, max |d logit| 0.031."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from hybridcache.cache.storage.hf_quantized import HFQuantizedStorage
from hybridcache.reference.hf_quantized_runner import run_hf_quantized
from tests.cache.test_hf_quantized import CASES, RECORDED, SPLITS, feed, inputs

pytestmark = pytest.mark.skipif(
    not os.environ.get("HYBRIDCACHE_HFQ_PYTHON"),
    reason="HYBRIDCACHE_HFQ_PYTHON is unset (a python with transformers 5.2 + "
    "optimum-quanto; see hybridcache/reference/hf_quantized_runner.py)",
)

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


def _real_model_case():
    from transformers import AutoTokenizer

    from experiments.study.data import encode, text_source, with_bos
    from hybridcache.checkpoints.real import RealCheckpointMissing, real_checkpoint

    try:
        path = real_checkpoint("gemma3_270m", quiet=True)
    except RealCheckpointMissing as e:
        pytest.skip(f"the real Gemma 3 270M checkpoint is not available: {e}")
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([with_bos(tok, encode(tok, text_source("pydoc")))[:464]])
    return path, ids[:, :400], ids[:, 400:]


@pytest.mark.parametrize("nbits", [4, 2])
def test_real_gemma3_nll_matches_hf_5_2_quantized_cache(nbits):
    import hybridcache as hc
    from hybridcache.reference.hf_quantized_runner import run_hf_quantized_model

    path, prompt, cont = _real_model_case()
    want = run_hf_quantized_model(path, prompt, cont, nbits=nbits, q_group_size=64, residual_length=128)
    model = hc.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = []
        for config in (
            {
                "attention": {
                    "storage": "hf_quantized",
                    "nbits": nbits,
                    "axis_key": 0,
                    "axis_value": 0,
                    "q_group_size": 64,
                    "residual": 128,
                }
            },
            None,
        ):
            cache = model.make_cache(1, config) if config else model.make_cache(1)
            first, rest = (getattr(o, "logits", o) for o in (model(prompt, cache=cache), model(cont, cache=cache)))
            logits.append(torch.cat([first[0, -1:], rest[0, :-1]]).float())
    got, native = logits
    nll = [torch.nn.functional.cross_entropy(x.double(), cont[0]).item() for x in (got, want, native)]
    assert abs(nll[0] - nll[1]) < 1e-3, nll
    assert nll[0] > nll[2] + 0.1, nll  # the quantized cache was really used (it costs NLL)
    assert (got - want).abs().max().item() < 0.1


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

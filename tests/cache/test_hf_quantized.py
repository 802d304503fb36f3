"""hf_quantized storage: identical to what HF transformers 5.2's QuantizedCache (quanto) returned, recorded in
tests/cache/data/hf_quantized_5.2.safetensors by tests/reference/test_hf_quantized_live.py (which also checks it
live); the flush rule by hand, quanto's refusals, bytes, crop and rows."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hybridcache.cache.core.errors import CacheConfigError, CacheCropError, CacheError
from hybridcache.cache.storage.hf_quantized import HFQuantizedStorage

RECORDED = Path(__file__).with_name("data") / "hf_quantized_5.2.safetensors"
SPLITS = [6, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1]  # 18 tokens: prefill, decode steps and a 3-token block, several flushes
CASES = {  # name -> QuantizedLayer arguments (nbits, axis_key, axis_value, q_group_size, residual_length)
    "4bit_axis0": dict(nbits=4, axis_key=0, axis_value=0, q_group_size=4, residual_length=4),
    "2bit_axis0": dict(nbits=2, axis_key=0, axis_value=0, q_group_size=8, residual_length=3),
    "2bit_keys_axis-1": dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=2, residual_length=5),
    "4bit_axis-1": dict(nbits=4, axis_key=-1, axis_value=-1, q_group_size=2, residual_length=2),
}


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 18, 8, generator=g), torch.randn(2, 1, 18, 8, generator=g)  # [B, H, N, D]


def feed(storage, k, v, splits):
    views, start = [], 0
    for n in splits:
        staged = storage.prepare(
            k[:, :, start : start + n], v[:, :, start : start + n], torch.arange(start, start + n).expand(k.shape[0], n)
        )
        storage.commit(staged)
        views.append((staged.keys, staged.values))
        start += n
    return views


@pytest.mark.parametrize("case", list(CASES))
def test_identical_to_recorded_hf_5_2(case):
    recorded = load_file(RECORDED)
    with safe_open(RECORDED, framework="pt") as f:
        assert f.metadata()["transformers"].startswith("5.2")
    k, v = recorded["inputs.keys"], recorded["inputs.values"]
    got = feed(HFQuantizedStorage(2, 1, 8, torch.float32, **CASES[case]), k, v, SPLITS)
    for i, (keys, values) in enumerate(got):
        assert torch.equal(keys, recorded[f"{case}.keys.{i}"]), i
        assert torch.equal(values, recorded[f"{case}.values.{i}"]), i


def test_flush_rule_by_hand():
    """R = 3: the prefill is quantized whole; the buffer is unarmed after it and after each flush."""
    k, v = inputs()
    s = HFQuantizedStorage(2, 1, 8, torch.float32, nbits=4, q_group_size=8, residual_length=3)
    views = feed(s, k, v, [4, 1, 1, 1, 1, 1, 1])
    assert torch.equal(views[0][0], k[:, :, :4])  # the prefill attends to itself unquantized
    quantized = s.dequantize(*s.quantize(k[:, :, :4], 0), 0)
    assert torch.equal(views[1][0][:, :, :4], quantized)
    # buffer before blocks 1..6: unarmed, 1, 2 (2 + 1 >= 3: flush), unarmed, 1, 2 (flush)
    assert [view[0].shape[2] for view in views] == [4, 5, 6, 7, 8, 9, 10]
    assert torch.equal(views[3][0][:, :, 4:7], k[:, :, 4:7])  # still dense when block 3 attends
    assert torch.equal(views[4][0][:, :, :7], s.dequantize(*s.quantize(views[3][0], 0), 0))  # all of it, anew
    assert torch.equal(views[6][0][:, :, 7:], k[:, :, 7:10])
    assert s.state()["k_dense"].shape[2] == 0 and not s.state()["armed"]


def test_bytes_are_what_is_held():
    k, v = inputs()
    s = HFQuantizedStorage(
        2, 1, 8, torch.float32, nbits=2, axis_key=-1, axis_value=0, q_group_size=4, residual_length=64
    )
    feed(s, k, v, [12, 1, 1])
    codes = 2 * 12 * 8 // 4  # 2-bit codes of the 12 prefill tokens, both rows
    keys = codes + 2 * (2 * 12 // 4) * 8 * 4  # axis -1: scale + min per channel and group of 4 rows of [B*H*N, D]
    values = codes + 2 * (2 * 12 * 8 // 4) * 4  # axis 0: scale + min per 4 consecutive elements
    assert s.nbytes() == keys + values + 2 * (2 * 2 * 8 * 4)  # + the dense buffer of 2 tokens


def test_quanto_refusals_are_named_errors_before_any_change():
    k, v = inputs()
    s = HFQuantizedStorage(2, 1, 8, torch.float32, axis_key=-1, q_group_size=4, residual_length=4)
    with pytest.raises(CacheError, match="q_group_size 4 must divide 10"):  # B * H * N = 2 * 1 * 5
        s.prepare(k[:, :, :5], v[:, :, :5], torch.arange(5).expand(2, 5))
    assert s.columns == 0
    with pytest.raises(CacheConfigError, match="axis_key"):
        HFQuantizedStorage(1, 1, 8, torch.float32, axis_key=1)
    with pytest.raises(CacheConfigError, match="nbits"):
        HFQuantizedStorage(1, 1, 8, torch.float32, nbits=8)


def test_crop_and_rows():
    k, v = inputs()
    s = HFQuantizedStorage(2, 1, 8, torch.float32, nbits=4, q_group_size=4, residual_length=8)
    feed(s, k, v, [6, 1, 1, 1])
    other = HFQuantizedStorage(2, 1, 8, torch.float32, nbits=4, q_group_size=4, residual_length=8)
    feed(other, k, v, [6, 1, 1])
    s.crop(8)  # the last decode token only sat in the buffer: exact
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(s.state().values(), other.state().values())
    )
    with pytest.raises(CacheCropError, match="snapshot"):
        s.crop(5)  # into the quantized prefill
    s.select(torch.tensor([1]))
    alone = HFQuantizedStorage(1, 1, 8, torch.float32, nbits=4, q_group_size=4, residual_length=8)
    feed(alone, k[1:], v[1:], [6, 1, 1])
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(s.state().values(), alone.state().values())
    )
    crossing = HFQuantizedStorage(2, 1, 8, torch.float32, axis_key=-1, q_group_size=4, residual_length=8)
    feed(crossing, k, v, [6])  # groups of 4 rows of [B*H*N = 12, D] cross the two batch rows
    with pytest.raises(CacheError, match="cross batch rows"):
        crossing.select(torch.tensor([0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"q_group_size": 0}, "q_group_size must be a positive integer, got 0"),
        ({"q_group_size": True}, "q_group_size must be a positive integer, got True"),
        ({"residual_length": -1}, "residual_length must be a non-negative integer, got -1"),
        ({"residual_length": 2.0}, "residual_length must be a non-negative integer, got 2.0"),
    ],
)
def test_bad_group_size_and_residual_length_are_named(kwargs, message):
    # q_group_size >= 1 and residual_length >= 0 (0: no dense buffer), each named with its own rule
    with pytest.raises(CacheConfigError, match=message):
        HFQuantizedStorage(1, 1, 8, torch.float32, **kwargs)
    HFQuantizedStorage(1, 1, 8, torch.float32, q_group_size=8, residual_length=0)

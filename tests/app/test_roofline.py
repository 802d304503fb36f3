"""The benchmark's roofline arithmetic against hand counts (no timing assertions)."""

from pathlib import Path

import pytest
import torch
from torch import nn

from experiments.benchmark.main import roofline
from experiments.benchmark.roofline import BandwidthProbe, roofline_row, weight_read_bytes


class Toy(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40 floats
        self.proj = nn.Linear(4, 4)  # 16 + 4 floats
        self.head = nn.Linear(4, 10, bias=False)  # 40 floats
        if tied:
            self.head.weight = self.embed.weight


def test_weight_bytes_count_a_tied_head_once_and_skip_untied_embeddings():
    assert weight_read_bytes(Toy(tied=True)) == {"weights": (40 + 20) * 4, "untied_embeddings_not_read": 0}
    assert weight_read_bytes(Toy(tied=False)) == {"weights": (20 + 40) * 4, "untied_embeddings_not_read": 40 * 4}
    half = Toy(tied=True).to(torch.bfloat16)
    assert weight_read_bytes(half)["weights"] == (40 + 20) * 2


def test_roofline_row():
    row = roofline_row("ours", 8, 40.0, weights=1000, cache_bytes=600, bandwidth=1e5)
    assert row["bytes_per_token"] == 200.0
    assert row["roofline_tok_s"] == 8 * 1e5 / 1600
    assert row["fraction"] == 40.0 / 500.0


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_probe_files_each_round_under_its_key_and_holds_its_buffer_in_its_own_process():
    before = _rss_kib()
    with BandwidthProbe(256 << 20, threads=1) as probe:
        assert _rss_kib() - before < 64 << 10  # (the 256 MiB buffer is the worker's, not this process's)
        ones = probe.round(1, 3)
        eights = probe.round(8, 1)
        assert all(0 < r < float("inf") for r in ones + eights)
        assert probe.samples == {1: ones, 8: eights}
        assert probe.median(1) == sorted(ones)[1] and probe.median(8) == eights[0]
        both = sorted(ones + eights)
        assert probe.median() == (both[1] + both[2]) / 2  # all 4 samples
        assert probe.median(2) is None
        for bad in (0, -1, True, 1.5):
            with pytest.raises(ValueError, match="at least one timed pass"):
                probe.round(1, bad)
        assert probe.samples == {1: ones, 8: eights}  # (a refused round files nothing)
    with pytest.raises(RuntimeError, match="closed"):
        probe.round(1, 1)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        BandwidthProbe(2)


def test_a_probe_whose_worker_dies_says_so_and_closes():
    probe = BandwidthProbe(4 << 20, threads=1)
    probe._worker.kill()  # (as the OOM killer would)
    probe._worker.wait()
    with pytest.raises(RuntimeError, match="worker .* ended with code -9"):
        probe.round(1, 2)
    assert probe.samples == {}
    with pytest.raises(RuntimeError, match="closed"):
        probe.round(1, 2)
    probe.close()  # (closing again does nothing)


def test_a_probe_whose_worker_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="worker .* ended with code"):
        BandwidthProbe(1 << 62)  # 4 EiB: the worker cannot allocate it


class ForgedProbe:
    """Rates as given (bytes/s), so the roofline's arithmetic is checked against hand counts."""

    def __init__(self, samples: dict):
        self.samples, self.nbytes = samples, 1 << 20

    def median(self, key=None):
        got = self.samples.get(key, []) if key is not None else [r for rs in self.samples.values() for r in rs]
        return sorted(got)[len(got) // 2] if got else None


def test_each_batch_divides_by_the_bandwidth_of_its_own_rounds():
    rows = [
        {"system": "ours", "batch": 1, "decode_tok_s": 5.0, "weights_bytes": 1000, "cache_bytes_read": 0},
        {"system": "ours", "batch": 8, "decode_tok_s": 40.0, "weights_bytes": 1000, "cache_bytes_read": 1000},
        {"system": "hf", "batch": 4, "decode_tok_s": None, "weights_bytes": 1000, "cache_bytes_read": 0},
        {"system": "vllm", "batch": 1, "decode_tok_s": 9.0},  # no byte counts: no roofline
    ]
    model = Toy(tied=True)
    model.dtype = torch.float32  # (what roofline reports the weights' dtype from, as a HybridLM has)
    roof = roofline(model, rows, ForgedProbe({1: [9e3, 10e3, 30e3], 8: [20e3, 20e3]}))
    assert rows[0]["roofline_tok_s"] == 1 * 10e3 / 1000 and rows[0]["roofline_fraction"] == 5.0 / 10.0
    assert rows[1]["roofline_tok_s"] == 8 * 20e3 / 2000 and rows[1]["roofline_fraction"] == 40.0 / 80.0
    # a batch size without rounds of its own (none here): every sample's median, and no fraction of no rate
    assert rows[2]["roofline_tok_s"] == 4 * 20e3 / 1000 and rows[2]["roofline_fraction"] is None
    assert "roofline_tok_s" not in rows[3]
    assert roof["read_bandwidth_gb_s"] == 20e3 / 1e9 and roof["read_bandwidth_range_gb_s"] == [9e3 / 1e9, 30e3 / 1e9]
    assert roof["read_bandwidth_by_batch_gb_s"] == {"1": 10e3 / 1e9, "8": 20e3 / 1e9} and roof["probe_passes"] == 5

"""Weights moved onto 2 MiB pages in place: same addresses, same values; nothing fails where it is unsupported."""

import torch

import hybridcache.accel.huge_pages as hp
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.models import from_pretrained


def _huge_kb_at(start: int, end: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping [start, end) (Linux /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_collapse_keeps_addresses_and_values():
    torch.manual_seed(0)
    a = torch.randn(3 << 20)  # 12 MiB: several whole 2 MiB blocks
    b = a[1000:].view(-1)  # a view shares the storage: counted once
    before, ptr = a.clone(), a.data_ptr()
    done = hp.collapse([a, b])
    assert a.data_ptr() == ptr and torch.equal(a, before)
    assert done % hp.HUGE == 0 and done <= a.numel() * 4 + 2 * hp.HUGE
    if done:  # where the kernel did it, the pages are huge now
        assert _huge_kb_at(ptr, ptr + a.numel() * 4) * 1024 >= done - 2 * hp.HUGE


def test_collapse_skips_small_and_foreign_tensors():
    small = torch.ones(100)
    assert hp.collapse([small]) == 0
    assert hp.collapse([torch.empty(1 << 22, device="meta")]) == 0


def test_unsupported_systems_change_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(hp, "_madvise", lambda *a: calls.append(a) or -1)  # every call fails (EINVAL, say)
    a = torch.randn(1 << 21)
    before = a.clone()
    assert hp.collapse([a]) == 0 and torch.equal(a, before) and calls
    monkeypatch.setattr(hp, "_madvise", False)  # no libc madvise at all
    assert hp.collapse([a]) == 0


def test_from_pretrained_reports_and_can_skip_it(tmp_path):
    path = tiny_checkpoint("gemma3", tmp_path)
    on = from_pretrained(path)
    off = from_pretrained(path, huge_pages=False)
    assert off.huge_page_bytes == 0 and on.huge_page_bytes >= 0
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(on(ids), off(ids))

"""Kernel dispatch: CPU tensors never touch the optional CUDA packages."""

import importlib

import pytest
import torch

import hybridcache.ops as ops

dispatch = importlib.import_module("hybridcache.ops._dispatch")


def test_cpu_calls_never_load_kernels(monkeypatch):
    def boom(*args):
        raise AssertionError(f"kernel import attempted on CPU: {args}")

    monkeypatch.setattr(dispatch, "load_kernel", boom)
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ops.causal_conv1d(r(1, 4, 5), r(4, 3), r(4), state=r(1, 4, 2), activation="silu")
    ops.causal_conv1d_step(r(1, 4), r(4, 3), None, r(1, 4, 2))
    ops.selective_scan(r(1, 4, 5), r(1, 4, 5), -r(4, 2).abs(), r(1, 2, 5), r(1, 2, 5), state=r(1, 4, 2))
    ops.selective_state_update(r(1, 4, 2), r(1, 4), r(1, 4), -r(4, 2).abs(), r(1, 2), r(1, 2))
    ops.ssd_scan(r(1, 5, 2, 3), r(1, 5, 2).abs(), -r(2).abs(), r(1, 5, 1, 2), r(1, 5, 1, 2), chunk_size=2)
    ops.ssd_step(r(1, 2, 3, 2), r(1, 2, 3), r(1, 2).abs(), -r(2).abs(), r(1, 1, 2), r(1, 1, 2))
    ops.linear_recurrence(r(1, 5, 3).sigmoid(), r(1, 5, 3))


def test_load_kernel_missing_package_is_none():
    dispatch.load_kernel.cache_clear()
    assert dispatch.load_kernel("hybridcache_no_such_module_xyz", "fn") is None


def test_disable_env(monkeypatch):
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    dispatch.load_kernel.cache_clear()
    try:
        assert dispatch.load_kernel("math", "sqrt") is None
        monkeypatch.setenv(dispatch.DISABLE_ENV, "0")
        dispatch.load_kernel.cache_clear()
        assert dispatch.load_kernel("math", "sqrt") is not None
    finally:
        dispatch.load_kernel.cache_clear()


@pytest.mark.parametrize("name", ops.__all__)
def test_public_api_exported(name):
    assert callable(getattr(ops, name))

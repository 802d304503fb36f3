"""CUDA kernel paths (mamba_ssm / causal_conv1d) vs the pure-torch paths (run on CPU copies)."""

import importlib

import pytest
import torch

import hybridcache.ops as ops

dispatch = importlib.import_module("hybridcache.ops._dispatch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA + mamba-ssm/causal-conv1d")

TOL = dict(rtol=2e-3, atol=2e-3)


def _need(module, name):
    pytest.importorskip(module.split(".")[0])
    if dispatch.load_kernel(module, name) is None:
        pytest.skip(f"{module}.{name} not importable (or kernels disabled)")


def _rand(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g)


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def _close(cuda_out, cpu_out, **tol):
    for a, b in zip(cuda_out, cpu_out):
        torch.testing.assert_close(a.cpu().float(), b.float(), **(tol or TOL))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d(k, with_state, dtype):
    _need("causal_conv1d", "causal_conv1d_fn")
    r = _rand(k)
    x, w, b = r(2, 64, 37).to(dtype), r(64, k), r(64)
    s = r(2, 64, k - 1).to(dtype) if with_state else None
    tol = TOL if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    _close(ops.causal_conv1d(*_cuda(x, w, b, s), activation="silu"), ops.causal_conv1d(x, w, b, s, "silu"), **tol)


@pytest.mark.parametrize("k", [2, 4])
def test_causal_conv1d_step(k):
    _need("causal_conv1d", "causal_conv1d_update")
    r = _rand(k)
    x, w, b, s = r(3, 64), r(64, k), r(64), r(3, 64, k - 1)
    xs, ws, bs, ss = _cuda(x, w, b, s)
    before = ss.clone()
    out = ops.causal_conv1d_step(xs, ws, bs, ss, activation="silu")
    torch.testing.assert_close(ss, before, rtol=0, atol=0)
    _close(out, ops.causal_conv1d_step(x, w, b, s, activation="silu"))


def _mamba1(seed, t=50, dm=64, n=16, bsz=2):
    r = _rand(seed)
    return dict(
        u=r(bsz, dm, t),
        delta=r(bsz, dm, t) * 0.5,
        A=-torch.rand(dm, n) * 2,
        B=r(bsz, n, t),
        C=r(bsz, n, t),
        D=r(dm),
        z=r(bsz, dm, t),
        delta_bias=r(dm) * 0.3,
        state=r(bsz, dm, n),
    )


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_z", [False, True])
def test_selective_scan(with_state, with_z):
    _need("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn")
    kw = _mamba1(0)
    kw["state"] = kw["state"] if with_state else None
    kw["z"] = kw["z"] if with_z else None
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    cpu = ops.selective_scan(*[kw[k] for k in names], delta_softplus=True, state=kw["state"])
    gpu = ops.selective_scan(*_cuda(*[kw[k] for k in names]), delta_softplus=True, state=_cuda(kw["state"])[0])
    assert gpu[1].dtype == torch.float32
    _close(gpu, cpu)


def test_selective_state_update():
    _need("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")
    kw = _mamba1(1, t=1)
    args = [
        kw["state"],
        kw["u"][..., 0],
        kw["delta"][..., 0],
        kw["A"],
        kw["B"][..., 0],
        kw["C"][..., 0],
        kw["D"],
        kw["z"][..., 0],
        kw["delta_bias"],
    ]
    gargs = _cuda(*args)
    before = gargs[0].clone()
    out = ops.selective_state_update(*gargs, delta_softplus=True)
    torch.testing.assert_close(gargs[0], before, rtol=0, atol=0)
    _close(out, ops.selective_state_update(*args, delta_softplus=True))


def _mamba2(seed, t=100, nh=8, p=16, g=2, n=16, bsz=2):
    r = _rand(seed)
    return dict(
        x=r(bsz, t, nh, p),
        dt=r(bsz, t, nh) * 0.5,
        A=-torch.rand(nh) * 2 - 0.1,
        B=r(bsz, t, g, n),
        C=r(bsz, t, g, n),
        D=r(nh),
        dt_bias=r(nh) * 0.3,
        state=r(bsz, nh, p, n),
    )


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 256])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_ssd_scan(with_state, chunk, limit):
    _need("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    kw = _mamba2(2)
    kw["state"] = kw["state"] if with_state else None
    names = ["x", "dt", "A", "B", "C"]
    opts = dict(chunk_size=chunk, dt_softplus=True, dt_limit=limit)
    cpu = ops.ssd_scan(*[kw[k] for k in names], D=kw["D"], dt_bias=kw["dt_bias"], state=kw["state"], **opts)
    d, dtb, st = _cuda(kw["D"], kw["dt_bias"], kw["state"])
    gpu = ops.ssd_scan(*_cuda(*[kw[k] for k in names]), D=d, dt_bias=dtb, state=st, **opts)
    assert gpu[1].dtype == torch.float32
    _close(gpu, cpu)


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_ssd_step(limit):
    _need("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")
    kw = _mamba2(3, t=1)
    args = [kw["state"], kw["x"][:, 0], kw["dt"][:, 0], kw["A"], kw["B"][:, 0], kw["C"][:, 0], kw["D"], kw["dt_bias"]]
    gargs = _cuda(*args)
    before = gargs[0].clone()
    out = ops.ssd_step(*gargs, dt_softplus=True, dt_limit=limit)
    torch.testing.assert_close(gargs[0], before, rtol=0, atol=0)
    _close(out, ops.ssd_step(*args, dt_softplus=True, dt_limit=limit))

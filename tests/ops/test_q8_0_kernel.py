"""The q8_0 weight format (hybridcache/ops/q8_0.py) and its C kernel hc_linear_q8_0, against a naive recompute of
the same quantized arithmetic written here: activations quantized per block of 32 (d = max|x| / 127, x * (1 / d)
rounded to nearest even), each block's int8 x int8 products summed exactly in int64, the blocks combined in
float64. The kernel sums in float32 in another order: the stated tolerance is 4e-6 of the sum of the products'
(and the bias') magnitudes (K / 32 <= 64 float32 block additions and 8 lanes, each within 2^-24 of its partial)."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import hybridcache.accel.native.library as cpu_library
from hybridcache.accel import kernel_status
from hybridcache.accel.native import rows
from hybridcache.accel.native.fused import gated_mlp
from hybridcache.accel.native.op_reference import gated_mlp as gated_mlp_reference
from hybridcache.nn.core.linear import linear
from hybridcache.ops import q8_0

pytestmark = pytest.mark.skipif(
    not kernel_status().startswith("C kernels"), reason="the C kernels are not built here (no compiler / not x86-64)"
)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def naive(x, q, scale, bias=None):
    """(y [M, N] float64, the sum of |block terms| [M, N]) by exact integer block sums."""
    xb = x.double().unflatten(-1, (-1, 32))  # [M, G, 32]
    d = (x.unflatten(-1, (-1, 32)).abs().amax(-1) / 127.0).double()  # float32 division, as the spec says
    inv = torch.where(d != 0, 1.0 / d.float(), 0.0).double()  # [M, G] the float32 reciprocal
    qx = torch.round((xb.float() * inv.float()[..., None]).double()).long()  # float32 product, ties to even
    qw = q.long().unflatten(-1, (-1, 32))
    isum = torch.einsum("mgk,ngk->mng", qx, qw)  # exact
    size = torch.einsum("mgk,ngk->mng", qx.abs(), qw.abs())  # the products' magnitudes (partial sums may cancel)
    both = scale.double()[None] * d[:, None, :]  # [M, N, G]
    y = (isum.double() * both).sum(-1) + (0 if bias is None else bias.double())
    return y, (size.double() * both.abs()).sum(-1) + (0 if bias is None else bias.double().abs())


# from 17 rows the prefill GEMM runs (gemm.c q8_gemm): row tiles of 6, panels of 16 weight rows, chunks of 512 rows
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 32),
        (1, 7, 640),
        (1, 1030, 2048),
        (3, 5, 96),
        (16, 33, 256),
        (17, 16, 32),
        (40, 9, 64),
        (131, 70, 640),
        (600, 20, 64),
    ],
)
def test_kernel_is_the_quantized_arithmetic(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, n)[:, None]
    w[0, :32] = 0  # an all-zero block
    x = torch.randn(m, k, generator=g) * 3
    x[-1, 32:64] = 0 if k > 32 else x[-1, 32:64]  # an all-zero activation block
    bias = torch.randn(n, generator=g)
    q, scale = q8_0.pack(w)
    for b in (None, bias):
        got = rows.decode_linear_q8_0(x, q, b, scale)
        assert got is not None and got.shape == (m, n) and got.dtype == torch.float32
        want, size = naive(x, q, scale, b)
        assert bool(((got.double() - want).abs() <= 4e-6 * size + 1e-30).all())
        torch.testing.assert_close(linear(x, q, b, scale), got, rtol=0, atol=0)  # the layer runs the kernel
        ref = q8_0.linear(x, q, scale, b)  # the torch path: the same integers, dequantized into one matmul
        assert bool(((ref.double() - want).abs() <= 4e-5 * size + 1e-6).all())


def test_tie_rounding_and_extremes():
    """Activations on exact .5 steps round to even (the kernel's rounding, not away from zero); huge and tiny
    magnitudes; a block with one nonzero value."""
    k = 64
    x = torch.zeros(3, k)
    x[0, :32] = torch.arange(32) - 15.5  # halves: max |x| 127 (below) makes d = 1 exactly, x / d the halves
    x[0, 0] = 127.0
    x[1, 32:] = torch.linspace(-1e30, 1e30, 32)
    x[2, 5] = 1e-30
    w = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    q, scale = q8_0.pack(w)
    got = rows.decode_linear_q8_0(x, q, None, scale)
    want, size = naive(x, q, scale)
    assert bool(((got.double() - want).abs() <= 4e-6 * size + 1e-37).all())


def llama_cpp_error(w):
    """Each block's squared error under llama.cpp's q8_0 rounding (scale max|block| / 127 in float16), by hand."""
    blocks = w.unflatten(-1, (-1, 32))
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = torch.round(blocks / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127)
    return (q * d[..., None] - blocks).square().sum(-1)


def test_pack_is_within_half_a_step_and_no_worse_than_llama_cpp():
    w = torch.randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]
    w[2, 32:64] = 0
    q, scale = q8_0.pack(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (64, 3)
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert bool((scale >= (amax / 127).half()).all() and (scale <= (amax / 119).half()).all())
    err = (q8_0.dequantize(q, scale) - w).unflatten(-1, (-1, 32))
    assert bool((err.abs() <= scale.float()[..., None] / 2 * (1 + 1e-3) + 1e-12).all())
    assert bool((err.square().sum(-1) <= llama_cpp_error(w) * (1 + 1e-5)).all())
    assert float(err.square().sum()) < 0.95 * float(llama_cpp_error(w).sum())  # the search pays
    assert bool((q[2, 32:64] == 0).all()) and int(q.abs().max()) <= 127


def test_hostile_inputs_are_refused_by_name():
    with pytest.raises(q8_0.Q8FormatError, match="divisible by 32"):
        q8_0.pack(torch.randn(4, 48))
    with pytest.raises(q8_0.Q8FormatError, match="finite"):
        q8_0.pack(torch.full((1, 32), float("nan")))
    with pytest.raises(q8_0.Q8FormatError, match="finite"):
        q8_0.pack(torch.full((1, 32), 1e10))  # its scale overflows float16
    q, scale = q8_0.pack(torch.randn(4, 64))
    with pytest.raises(q8_0.Q8FormatError, match="scales must be float16"):
        linear(torch.randn(2, 64), q, None, scale.float())
    with pytest.raises(q8_0.Q8FormatError, match="divisible by 32"):
        linear(torch.randn(2, 48), q[:, :48].contiguous(), None, scale[:, :1].contiguous())
    with pytest.raises(q8_0.Q8FormatError, match="int8"):
        linear(torch.randn(2, 64), q.float(), None, scale)


class _NoC:
    def __getattr__(self, name):
        raise AssertionError(f"C function {name} reached with arguments its wrapper must decline")


def test_layouts_the_kernel_does_not_take_never_reach_c(monkeypatch):
    """A non-contiguous weight or scale, a transposed input's wrong width, a float64 input: the wrapper declines
    (None) without touching C, and the layer computes them by the torch path."""
    q, scale = q8_0.pack(torch.randn(8, 128))
    x = torch.randn(3, 128)
    want = q8_0.linear(x, q, scale)
    wide_q = torch.zeros(8, 256, dtype=torch.int8)
    wide_q[:, ::2] = q
    wide_s = torch.zeros(8, 8, dtype=torch.float16)
    wide_s[:, ::2] = scale
    monkeypatch.setattr(cpu_library, "_state", {"lib": _NoC()})
    for args in ((x, wide_q[:, ::2], None, scale), (x, q, None, wide_s[:, ::2]), (x.double(), q, None, scale)):
        assert not args[1].is_contiguous() or not args[3].is_contiguous() or args[0].dtype == torch.float64
        assert rows.decode_linear_q8_0(*args) is None
    torch.testing.assert_close(linear(x, wide_q[:, ::2], None, scale), want, rtol=0, atol=0)
    assert rows.decode_linear_q8_0(torch.randn(3, 96), q, None, scale) is None  # widths differ


def test_fused_mlp_with_q8_0_matrices_is_the_reference():
    g = torch.Generator().manual_seed(3)
    d, i = 64, 96
    wg, sg = q8_0.pack(torch.randn(2 * i, d, generator=g))
    wd, sd = q8_0.pack(torch.randn(d, i, generator=g) / 8)
    x = torch.randn(2, 1, d, generator=g)
    got = gated_mlp(x, (wg, None, sg), (wd, None, sd), "silu")
    assert got is not None  # the fused kernel took the q8_0 matrices (type code 3)
    torch.testing.assert_close(got, gated_mlp_reference(x, wg, None, sg, wd, None, sd, "silu"), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the portable (scalar) variant")
def test_the_scalar_variant_is_the_same_arithmetic(tmp_path):
    """The kernels compiled for plain x86-64 / any CPU without avx2 (no F16C either: float16 scales converted in
    software, subnormal ones included) compute the same block sums."""
    src = Path(rows.__file__).with_name("csrc") / "cpu_decode.c"
    so = tmp_path / "scalar.so"
    flags = ["-O1", "-shared", "-fPIC", "-std=gnu11", "-mno-avx", "-mno-avx2", "-mno-f16c", "-mno-fma"]
    subprocess.run(["cc", *flags, str(src), "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.hc_isa.restype = ctypes.c_char_p
    assert lib.hc_isa() == b"scalar"
    g = torch.Generator().manual_seed(5)
    for m, n, k in [(1, 9, 64), (3, 17, 640), (20, 5, 96)]:
        w = torch.randn(n, k, generator=g) * torch.logspace(-6, 1, n)[:, None]  # float16 subnormal scales too
        x, b, y = torch.randn(m, k, generator=g), torch.randn(n, generator=g), torch.empty(m, n)
        q, s = q8_0.pack(w)
        p = ctypes.c_void_p
        lib.hc_linear_q8_0(p(x.data_ptr()), p(q.data_ptr()), p(y.data_ptr()), p(s.data_ptr()), p(b.data_ptr()), m, n, k)
        want, size = naive(x, q, s, b)
        assert bool(((y.double() - want).abs() <= 4e-6 * size + 1e-30).all())

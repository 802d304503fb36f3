"""The CPU decode kernels (hybridcache/accel/native/csrc/cpu_decode.c) against float64 references and the torch paths.

Building and loading: test_native_build.py, test_kernel_tamper.py; odd inputs: test_kernel_fuzz.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache.accel.native.kernels as dl
from hybridcache.nn.core.linear import linear, pack_matrix, reference_linear
from tests.ops.test_ops_attention import naive_attention


def _reference(x, w, bias, scale):
    """float64: x @ widened(w)^T * scale + bias."""
    out = x.double() @ w.double().T
    if scale is not None:
        out = out * scale.double()
    return out if bias is None else out + bias.double()


def _bound(x, w, scale, bias=None):
    """float32 rounding bound of a K-term dot product: ~K * eps * sum|x||w| (generous constant), plus the rounding
    of the bias addition (~eps * (|sum| + |bias|))."""
    mag = x.double().abs() @ w.double().abs().T
    if scale is not None:
        mag = mag * scale.double()
    if bias is not None:
        mag = mag + bias.double().abs()
    return 4 * (x.shape[-1] + 1) * 2**-24 * mag + 1e-30


@pytest.fixture(autouse=True)
def _kernel():
    if dl._library() is None:
        pytest.skip(f"no decode kernel here: {dl.kernel_status()}")


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, dl.MAX_ROWS),
    n=st.integers(1, 37),
    k=st.integers(1, 70),
    fmt=st.sampled_from(["float32", "bfloat16", "int8"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_matches_float64(rows, n, k, fmt, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w32 = torch.randn(n, k, generator=g)
    w, scale = (w32, None) if fmt == "float32" else pack_matrix(w32, fmt)
    b = torch.randn(n, generator=g) if bias else None
    with torch.no_grad():
        out = dl.decode_linear(x, w, b, scale)
    assert out is not None and out.shape == (rows, n) and out.dtype == torch.float32
    err = (out.double() - _reference(x, w, b, scale)).abs()
    assert bool((err <= _bound(x, w, scale, b)).all()), float(err.max())


@pytest.mark.parametrize("rows", [1, 7, 8])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_small_batch_tiles_every_tail(fmt, rows):
    """Batch 1 takes its own tile (4 weight rows, two sums per row, 2 vector widths per step), batches 7-8 two
    passes of at most 4 rows on avx2: K around every step and tail size of avx2 / avx512, N with and without a
    partial last tile, against float64."""
    g = torch.Generator().manual_seed(7)
    for n in (4, 7, 66):
        for k in (1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 640):
            x = torch.randn(rows, k, generator=g)
            w32 = torch.randn(n, k, generator=g)
            w, scale = (w32, None) if fmt == "float32" else pack_matrix(w32, fmt)
            b = torch.randn(n, generator=g)
            with torch.no_grad():
                out = dl.decode_linear(x, w, b, scale)
            err = (out.double() - _reference(x, w, b, scale)).abs()
            assert bool((err <= _bound(x, w, scale, b)).all()), (n, k, float(err.max()))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_gemm_for_many_rows_every_tail(fmt):
    """More than MAX_ROWS rows (a prefill) take the GEMM kernel: row tiles of 6 with every tail, column panels of 2
    vector widths with every tail, K in blocks of 512 (sums carried across blocks), against float64."""
    g = torch.Generator().manual_seed(11)
    for rows in (dl.MAX_ROWS + 1, 23, 40, 131):
        for n, k in ((1, 9), (15, 1), (16, 511), (17, 512), (33, 513), (100, 1100), (40, 64)):
            x = torch.randn(rows, k, generator=g)
            w32 = torch.randn(n, k, generator=g)
            w, scale = (w32, None) if fmt == "float32" else pack_matrix(w32, fmt)
            b = torch.randn(n, generator=g) if n % 2 else None
            with torch.no_grad():
                out = dl.decode_linear(x, w, b, scale)
            assert out is not None and out.shape == (rows, n)
            err = (out.double() - _reference(x, w, b, scale)).abs()
            assert bool((err <= _bound(x, w, scale, b)).all()), (rows, n, k, float(err.max()))


@pytest.mark.parametrize("lead", [(1,), (2, 1), (3, 5)])
def test_leading_dims_and_noncontiguous_rows(lead):
    x = torch.randn(*lead, 48)[..., ::2]  # [..., 24], strided
    w = torch.randn(10, 24)
    with torch.no_grad():
        out = dl.decode_linear(x, w)
    assert out.shape == (*lead, 10)
    torch.testing.assert_close(out.double(), _reference(x, w, None, None), rtol=1e-5, atol=1e-5)


def test_what_the_kernel_declines_goes_to_torch():
    w = torch.randn(8, 16)
    cases = {"float64 rows": torch.randn(2, 16, dtype=torch.float64), "no rows": torch.randn(0, 16)}
    with torch.no_grad():
        for what, x in cases.items():
            assert dl.decode_linear(x, w) is None, what
            torch.testing.assert_close(linear(x, w.to(x.dtype)), x @ w.to(x.dtype).T)
        assert dl.decode_linear(torch.randn(2, 16), w.T.contiguous().T) is None  # a strided weight
    x = torch.randn(2, 16, requires_grad=True)
    assert dl.decode_linear(x, w) is None  # autograd: torch keeps the graph
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 16))


def test_reference_path_equals_the_kernel_for_packed_weights():
    x = torch.randn(3, 40)
    for fmt in ("bfloat16", "int8"):
        w, scale = pack_matrix(torch.randn(12, 40), fmt)
        b = torch.randn(12)
        with torch.no_grad():
            torch.testing.assert_close(
                dl.decode_linear(x, w, b, scale), reference_linear(x, w, b, scale), rtol=1e-5, atol=1e-5
            )


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), d=st.integers(1, 70), eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_float64(rows, d, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, d, generator=g) * 3, torch.randn(d, generator=g)
    with torch.no_grad():
        out = dl.rms_norm(x, w, eps)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 6, 8]),
    s=st.integers(1, 40),
    d=st.integers(1, 40),
    softcap=st.sampled_from([None, 5.0]),
    p_visible=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_decode_attention_matches_the_torch_path(b, hkv, group, s, d, softcap, p_visible, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, 1, d, generator=g)
    kv = torch.randn(b, hkv, s, 2 * d, generator=g)  # keys and values as strided views of one tensor
    k, v = kv[..., :d], kv[..., d:]
    mask = torch.rand(b, 1, s, generator=g) < p_visible
    k = k.masked_fill(~mask[:, :, :, None], float("nan"))  # garbage in hidden slots stays hidden
    with torch.no_grad():
        out = dl.decode_attention(q, k, v, mask, d**-0.5, softcap)
    assert out is not None and out.shape == q.shape
    want = naive_attention(q, torch.nan_to_num(k), v, mask, d**-0.5, softcap)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_declines_what_it_does_not_take():
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 5, 8)  # two queries
    mask = torch.ones(1, 2, 5, dtype=torch.bool)
    with torch.no_grad():
        assert dl.decode_attention(q, k, k, mask, 1.0, None) is None
        assert dl.decode_attention(q[:, :, :1].double(), k.double(), k.double(), mask[:, :1], 1.0, None) is None
        assert dl.decode_attention(q[:, :, :1], k, torch.randn(1, 1, 5, 4), mask[:, :1], 1.0, None) is None


@pytest.mark.parametrize("kind, param", [("full", 0), ("sliding", 4), ("chunked", 5)])
def test_decode_attention_from_positions_equals_the_mask(kind, param):
    from hybridcache.cache.attention.specs import ChunkedSpec, FullSpec, SlidingSpec

    spec = {"full": FullSpec, "sliding": SlidingSpec, "chunked": ChunkedSpec}[kind]
    extra = {"window": param} if kind == "sliding" else {"chunk_size": param} if kind == "chunked" else {}
    spec = spec(num_kv_heads=2, head_dim=8, **extra)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 4, 1, 8, generator=g),
        torch.randn(3, 2, 11, 8, generator=g),
        torch.randn(3, 2, 11, 8, generator=g),
    )
    kpos = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8], list(range(11)), [-1] * 10 + [0]])
    qpos = torch.tensor([[8], [10], [-1]])  # row 2: a padding query sees nothing
    mask = (qpos[:, :, None] >= 0) & (kpos[:, None, :] >= 0) & spec.visible(qpos[:, :, None], kpos[:, None, :])
    with torch.no_grad():
        by_positions = dl.decode_attention(q, k, v, None, 0.3, None, positions=(qpos, kpos, kind, param))
        by_mask = dl.decode_attention(q, k, v, mask, 0.3, None)
    assert by_positions is not None and torch.equal(by_positions, by_mask)
    assert torch.equal(by_positions[2], torch.zeros_like(by_positions[2]))
    torch.testing.assert_close(by_mask.double(), naive_attention(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [8, 4])
def test_rope_kernel_matches_the_torch_path(interleaved, rot):
    from hybridcache.nn.attention.rotary import RotaryEmbedding

    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    rotary = RotaryEmbedding(inv, interleaved=interleaved)
    q, k = torch.randn(2, 3, 1, 8), torch.randn(2, 1, 1, 8)
    positions = torch.tensor([[5], [17]])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    with torch.no_grad():
        got = dl.rope(q, cos, sin, interleaved), dl.rope(k, cos, sin, interleaved)
        with torch.enable_grad():  # the torch path (the kernel declines under autograd)
            want = rotary(q, k, positions)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("visible", ["all", "second half", "a few", "none"])
def test_decode_attention_split_over_slots_equals_the_reference(visible):
    """Long enough that one (row, kv head) is split over threads, whose partial softmaxes are combined."""
    g = torch.Generator().manual_seed(1)
    s = 700
    q, k, v = (
        torch.randn(1, 2, 1, 64, generator=g),
        torch.randn(1, 1, s, 64, generator=g),
        torch.randn(1, 1, s, 64, generator=g),
    )
    mask = torch.zeros(1, 1, s, dtype=torch.bool)
    if visible == "all":
        mask[:] = True
    elif visible == "second half":
        mask[..., s // 2 :] = True
    elif visible == "a few":
        mask[..., [3, 350, 699]] = True
    with torch.no_grad():
        out = dl.decode_attention(q, k, v, mask, 0.125, None)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask, 0.125), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    visible=st.integers(1, 700),
    before=st.integers(0, 300),
    after=st.integers(0, 40),
    kind=st.sampled_from(["full", "sliding"]),
    seed=st.integers(0, 2**31 - 1),
)
@torch.no_grad()
def test_decode_attention_depends_on_the_visible_slots_only(b, visible, before, after, kind, seed):
    """The same visible keys with hidden slots around them (older positions out of a window, padding, slots
    reserved ahead with later positions) give the same bits: what lets a decode that reserved slots ahead, or
    whose cache evicts later, match one step at a time exactly. Long rows split over threads by visible count."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, 1, 64, generator=g)
    k, v = torch.randn(b, 1, visible, 64, generator=g), torch.randn(b, 1, visible, 64, generator=g)
    qpos = torch.full((b, 1), 5000)
    kpos = torch.arange(5000 - visible + 1, 5001).expand(b, visible).contiguous()
    window = visible if kind == "sliding" else 0
    plain = dl.decode_attention(q, k, v, None, 0.125, None, positions=(qpos, kpos, kind, window))
    noise = lambda n: torch.randn(b, 1, n, 64, generator=g) * 1e3  # noqa: E731
    k2, v2 = torch.cat([noise(before), k, noise(after)], 2), torch.cat([noise(before), v, noise(after)], 2)
    old = 5000 - visible - torch.arange(before, 0, -1) if kind == "sliding" else torch.full((before,), -1)
    kpos2 = torch.cat([old.expand(b, before), kpos, torch.arange(5001, 5001 + after).expand(b, after)], 1)
    padded = dl.decode_attention(q, k2, v2, None, 0.125, None, positions=(qpos, kpos2.contiguous(), kind, window))
    assert plain is not None and padded is not None and torch.equal(plain, padded)
    every = torch.ones(b, 1, visible, dtype=torch.bool)
    torch.testing.assert_close(plain.double(), naive_attention(q, k, v, every, 0.125), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 9),
    dm=st.integers(1, 20),
    n=st.sampled_from([1, 5, 16, 21]),
    optional=st.booleans(),
    softplus=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_selective_scan_kernel_matches_the_reference(b, t, dm, n, optional, softplus, seed):
    from hybridcache.ops.selective_scan import _selective_scan_torch

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    u, delta, z = r(b, t, 2 * dm)[..., ::2], r(b, t, dm) * 0.5, r(b, t, dm)  # u strided over channels' batch rows
    u = u.contiguous() if u.stride(-1) != 1 else u
    bm, cm = r(b, t, n), r(b, t, n)
    a = -torch.exp(r(dm, n) * 0.5)
    d, bias, state = (r(dm), r(dm), r(b, dm, n)) if optional else (None, None, None)
    with torch.no_grad():
        out = dl.selective_scan(u, delta, z if optional else None, bm, cm, a, d, bias, softplus, state)
    assert out is not None
    tr = lambda v: None if v is None else v.transpose(1, 2).double()
    y, last = _selective_scan_torch(
        tr(u),
        tr(delta),
        a.double(),
        tr(bm),
        tr(cm),
        None if d is None else d.double(),
        tr(z) if optional else None,
        None if bias is None else bias.double(),
        softplus,
        None if state is None else state.double(),
    )
    torch.testing.assert_close(out[0].double(), y.transpose(1, 2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1].double(), last, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "norm, rot, interleaved", [(True, 8, False), (True, 4, True), (False, 8, False), (True, 0, False)]
)
def test_norm_rope_kernel_matches_the_modules(norm, rot, interleaved):
    from hybridcache.nn.attention.rotary import RotaryEmbedding
    from hybridcache.nn.core.norms import RMSNorm

    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 3, 5, 8, generator=g)  # [B, T, H, D]: q as a strided view, as the mixer has it
    x = qkv.transpose(1, 2)  # [B, H, T, D]
    rms = RMSNorm(8, 1e-6, unit_offset=True)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(8, generator=g) * 0.1)
    rotary = (
        RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)), interleaved=interleaved)
        if rot
        else None
    )
    positions = torch.tensor([[0, 4, 9], [2, 3, 30]])
    cos, sin = rotary.cos_sin(positions, torch.float32) if rotary else (None, None)
    with torch.no_grad():
        got = dl.norm_rope(x, rms.kernel_scale() if norm else None, rms.eps, cos, sin, interleaved)
    with torch.enable_grad():  # the modules' torch paths (kernels decline under autograd)
        want = rms(x) if norm else x
        if rotary:
            want = rotary(want, want, positions)[0]
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)

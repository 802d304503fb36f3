"""Our Mamba ops against the mamba authors' pure-torch references (mamba-ssm, causal-conv1d: the `mamba-ref` extra).

Independent references on CPU, on randomized shapes (several seeds each), float32 and float64 where the reference
supports it:

- `selective_scan` (Mamba1, the pure-torch path) and `selective_scan_btd` (on CPU float32: the C kernel
  `hc_selective_scan`, hybridcache/accel/native/csrc/cpu_decode.c) vs `selective_scan_ref`, with and without D, z,
  delta_bias, delta_softplus, the returned last state, and an initial state (a sequence split in two, the state passed
  on). `selective_scan_ref` computes in float32 only (it casts u and delta with `.float()`); float64 is checked
  against T steps of `selective_state_update_ref`, which keeps the input dtype.
- `selective_state_update` (one Mamba1 token) and the C kernel with T = 1 (the Mamba block's CPU float32 decode
  step) vs `selective_state_update_ref`.
- `causal_conv1d` (prefill, with / without initial state, bias, silu; widths 2..5; sequences shorter than the width)
  vs `causal_conv1d_ref` with `return_final_states`; `causal_conv1d_step` vs `causal_conv1d_update_ref`.
- `ssd_scan` (Mamba2 chunked SSD) vs `ssd_minimal_discrete` (the SSD paper's listing) with and without an initial
  state, final state included, for chunk sizes that do not divide the length; with D / dt_bias / dt_softplus /
  dt_limit vs `ssd_chunk_scan_combined_ref`. `ssd_step` vs the multi-head `selective_state_update_ref`.
- The CUDA dispatch glue of each op (state superposition for `selective_scan_fn`, the width-K conv buffer, the tied
  head-dim expansion for the Mamba2 step), run on CPU with the authors' reference standing in for the kernel of the
  same signature.
- Where CUDA and the `cuda` extra's kernels are present, the same comparisons run with our ops on CUDA tensors (so
  through the kernels), float32 only.

Native CPU kernels: the ops dispatch to exactly one on CPU, `hc_selective_scan` (Mamba1 scan, prefill and decode).
The Mamba2 step / SSD and the conv step have no native CPU kernel; `test_every_native_scan_kernel_is_compared` fails
when one is added to cpu_decode.c without being listed here.

Tolerances. float64: both sides compute in float64 and differ only in summation order, over at most ~48 steps of a
contracting recurrence with O(1) inputs: measured max error 7e-15, asserted at 1e-10. float32: the same with float32's
eps (1.2e-7) times the recurrence length and the state size (up to 48 x 16 terms) on outputs of magnitude up to ~25:
measured max error 4.8e-6, asserted at rtol = atol = 5e-5 (a 10x margin for other CPUs' vector exp / summation order;
the atol for outputs near 0). `ssd_chunk_scan_combined_ref` casts dt to float32 in every dtype, so it is compared at
the float32 tolerance. The CUDA kernels: 2e-3, as in tests/ops/test_ops_cuda_kernels.py (not run on a GPU yet). Set
MAMBA_REF_ERRORS=<file> to append every comparison's max error to that file.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from einops import repeat

from hybridcache.accel.native import kernels as cpu_kernels
from hybridcache.ops import (
    causal_conv1d,
    causal_conv1d_step,
    selective_scan,
    selective_state_update,
    ssd_scan,
    ssd_step,
)
from hybridcache.ops._dispatch import load_kernel
from hybridcache.ops.selective_scan_btd import selective_scan_btd
from tests.reference import mamba_refs

_reason = mamba_refs.missing()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

ss_mod = importlib.import_module("hybridcache.ops.selective_scan")
conv_mod = importlib.import_module("hybridcache.ops.conv")
ssd_mod = importlib.import_module("hybridcache.ops.ssd")

F32, F64 = torch.float32, torch.float64
TOL = {F32: dict(rtol=5e-5, atol=5e-5), F64: dict(rtol=1e-10, atol=1e-10)}
CUDA_TOL = dict(rtol=2e-3, atol=2e-3)
SEEDS = range(4)
# Every native CPU kernel of a scan / state update / conv in cpu_decode.c, and the test that compares it.
NATIVE = {
    "hc_selective_scan": ("test_native_selective_scan", "test_native_selective_scan_decode_step"),
    # The one-call decode steps (csrc/recurrent_step.c: projections, conv, state update, gate) are compared in
    # tests/ops/test_recurrent_step.py against our torch ops, whose conv step, SSD step and selective state update are
    # compared against causal-conv1d's and mamba-ssm's references in this file (test_causal_conv1d_step,
    # test_ssd_step, test_selective_state_update). Neither package has a gated delta rule: that op is checked against
    # a naive recurrence (tests/ops/test_ops_gated_delta.py).
    "hc_short_conv_step": ("tests.ops.test_recurrent_step::test_short_conv_step_matches_the_ops",),
    "hc_mamba2_step": ("tests.ops.test_recurrent_step::test_mamba2_step_matches_the_ops",),
    "hc_mamba_step": ("tests.ops.test_recurrent_step::test_mamba_step_matches_the_selective_step_in_torch",),
    "hc_gated_delta_step": ("tests.ops.test_recurrent_step::test_gated_delta_step_matches_the_ops",),
    # the variants' steps against the reference modules' own forward (Qwen3.5 / OLMo / KDA, RG-LRU, Zamba's Mamba1)
    "hc_delta_step": ("tests.ops.test_recurrent_step_variants::test_delta_step_matches_the_reference_module",),
    "hc_rglru_step": ("tests.ops.test_recurrent_step_variants::test_rglru_step_matches_the_reference_block",),
    "hc_mamba_groups_step": ("tests.ops.test_recurrent_step_variants::test_mamba_groups_step_matches_zambas_mixer",),
}


@pytest.fixture(scope="module")
def refs() -> mamba_refs.Refs:
    return mamba_refs.load()


def _cuda_kernels(*names: tuple[str, str]) -> bool:
    return torch.cuda.is_available() and all(load_kernel(m, n) is not None for m, n in names)


def _cuda_param(kernels: tuple, *values, id: str) -> list:
    """The CUDA case (our ops through the kernels), only where CUDA is: skipped, saying why, without the kernels."""
    if not torch.cuda.is_available():
        return []
    mark = pytest.mark.skipif(
        not _cuda_kernels(*kernels),
        reason="needs the cuda extra's kernels (mamba-ssm / "
        "causal-conv1d built with CUDA): " + ", ".join(".".join(k) for k in kernels),
    )
    return [pytest.param(*values, id=id, marks=mark)]


# (device, dtype) pairs: CPU in both dtypes; CUDA (the kernels take float32 / half only) in float32.
def _cases(*kernels: tuple[str, str]) -> list:
    cases = [pytest.param("cpu", F32, id="cpu-f32"), pytest.param("cpu", F64, id="cpu-f64")]
    return cases + _cuda_param(kernels, "cuda", F32, id="cuda-f32")


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, device: str = "cpu", what: str = "") -> None:
    ours, ref = ours.detach().cpu(), ref.detach().cpu()
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    tol = CUDA_TOL if device == "cuda" else TOL[dtype]
    err = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    if os.environ.get("MAMBA_REF_ERRORS"):
        with open(os.environ["MAMBA_REF_ERRORS"], "a") as f:
            f.write(
                f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{what}\t{dtype}\t{device}\t"
                f"{err:.3e}\t{ref.abs().max().item() if ref.numel() else 0:.3e}\n"
            )
    torch.testing.assert_close(ours.to(ref.dtype), ref, **tol, msg=lambda m: f"{what}: {m}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ints(g: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (), generator=g))


# --- Mamba1 ----------------------------------------------------------------------------------------------------------

OPTIONS = {  # name -> (D, z, delta_bias, delta_softplus)
    "plain": (False, False, False, False),
    "all": (True, True, True, True),
    "D-softplus": (True, False, False, True),
    "z-bias": (False, True, True, False),
}


def _mamba1(seed: int, dtype: torch.dtype, options: str, t: int | None = None):
    """Random Mamba1 inputs [B, Dm, T] / [B, N, T] as the block builds them (delta > 0 or softplus-ed, A < 0)."""
    g = _gen(seed)
    b, dm, n = _ints(g, 1, 3), _ints(g, 1, 9), _ints(g, 1, 16)
    t = _ints(g, 1, 48) if t is None else t
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)
    use_d, use_z, use_bias, softplus = OPTIONS[options]
    pos = lambda *s: torch.rand(*s, generator=g, dtype=F64).to(dtype) * 0.5
    # without softplus, delta (+ bias) is used as is: kept >= 0 so that exp(delta A) decays, as in a trained model
    delta, bias = (r(b, dm, t) - 1.0, r(dm) * 0.5) if softplus else (pos(b, dm, t), pos(dm))
    A = -torch.exp(r(dm, n) * 0.5)
    return dict(
        u=r(b, dm, t),
        delta=delta,
        A=A,
        B=r(b, n, t),
        C=r(b, n, t),
        D=r(dm) if use_d else None,
        z=r(b, dm, t) if use_z else None,
        delta_bias=bias if use_bias else None,
        delta_softplus=softplus,
    )


def _to(kw: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _steps_ref(refs, kw: dict, state: torch.Tensor | None = None):
    """The scan as T calls of the authors' selective_state_update_ref (it keeps float64; it updates state in place)."""
    b, dm, t = kw["u"].shape
    h = (kw["u"].new_zeros(b, dm, kw["A"].shape[1]) if state is None else state.clone()).to(kw["u"].dtype)
    ys = [
        refs.selective_state_update_ref(
            h,
            kw["u"][..., i],
            kw["delta"][..., i],
            kw["A"],
            kw["B"][..., i],
            kw["C"][..., i],
            D=kw["D"],
            z=None if kw["z"] is None else kw["z"][..., i],
            dt_bias=kw["delta_bias"],
            dt_softplus=kw["delta_softplus"],
        )
        for i in range(t)
    ]
    return torch.stack(ys, dim=-1), h


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", id="cpu"),
        *_cuda_param((("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),), "cuda", id="cuda"),
    ],
)
def test_selective_scan(refs, seed, options, device):
    kw = _mamba1(seed, F32, options)
    y_ref, last_ref = refs.selective_scan_ref(**kw, return_last_state=True)
    y, last = selective_scan(**_to(kw, device))
    _close(y, y_ref, F32, device, "y")
    _close(last, last_ref, F32, device, "last state")


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_selective_scan_float64(refs, seed, options):
    """selective_scan_ref casts to float32: T steps of selective_state_update_ref are the float64 reference."""
    kw = _mamba1(seed, F64, options)
    y_ref, last_ref = _steps_ref(refs, kw)
    y, last = selective_scan(**kw)
    assert y.dtype == last.dtype == F64
    _close(y, y_ref, F64, what="y")
    _close(last, last_ref, F64, what="last state")
    kw32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    y32 = refs.selective_scan_ref(**kw32)  # the two references agree (in float32)
    _close(y32, y_ref, F32, what="selective_scan_ref vs the steps")


def _split(kw: dict, cut: int):
    def part(sl):
        return {k: (v[..., sl] if isinstance(v, torch.Tensor) and v.dim() == 3 else v) for k, v in kw.items()}

    return part(slice(0, cut)), part(slice(cut, None))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_selective_scan_initial_state(refs, seed, dtype):
    """The reference over the whole sequence == ours over two parts, the first part's last state passed on."""
    kw = _mamba1(seed, dtype, "all", t=_ints(_gen(100 + seed), 2, 40))
    cut = _ints(_gen(200 + seed), 1, kw["u"].shape[-1] - 1)
    y_ref, last_ref = _steps_ref(refs, kw) if dtype == F64 else refs.selective_scan_ref(**kw, return_last_state=True)
    first, second = _split(kw, cut)
    y1, h = selective_scan(**first)
    y2, last = selective_scan(**second, state=h)
    _close(torch.cat([y1, y2], dim=-1), y_ref, dtype, what="y")
    _close(last, last_ref, dtype, what="last state")


def _btd(kw: dict) -> dict:
    """[B, C, T] -> [B, T, C] for the Mamba block's layout, as strided views (what the block passes)."""
    return {k: (v.transpose(1, 2) if isinstance(v, torch.Tensor) and v.dim() == 3 else v) for k, v in kw.items()}


def _need_native():
    if not cpu_kernels.kernel_available():
        pytest.skip(f"the CPU kernels are not built here: {cpu_kernels.kernel_status()}")


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_native_selective_scan(refs, seed, options):
    """hc_selective_scan (selective_scan_btd on CPU float32) vs selective_scan_ref, then split with a state."""
    _need_native()
    kw = _mamba1(seed, F32, options, t=_ints(_gen(300 + seed), 2, 48))
    y_ref, last_ref = refs.selective_scan_ref(**kw, return_last_state=True)
    with torch.no_grad():
        b = _btd(kw)
        args = (b["u"], b["delta"], b["z"], b["B"], b["C"], kw["A"], kw["D"], kw["delta_bias"], kw["delta_softplus"])
        assert cpu_kernels.selective_scan(*args, None) is not None, "the native kernel did not take these inputs"
        y, last = selective_scan_btd(**b)
        _close(y.transpose(1, 2), y_ref, F32, what="y")
        _close(last, last_ref, F32, what="last state")
        cut = _ints(_gen(400 + seed), 1, kw["u"].shape[-1] - 1)
        first, second = (_btd(p) for p in _split(kw, cut))
        y1, h = selective_scan_btd(**first)
        y2, last = selective_scan_btd(**second, state=h)
    _close(torch.cat([y1, y2], dim=1).transpose(1, 2), y_ref, F32, what="y (split)")
    _close(last, last_ref, F32, what="last state (split)")


def _mamba1_step(seed: int, dtype: torch.dtype, options: str):
    kw = _mamba1(seed, dtype, options, t=1)
    step = {k: (v[..., 0] if isinstance(v, torch.Tensor) and v.dim() == 3 else v) for k, v in kw.items()}
    b, dm = step["u"].shape
    state = torch.randn(b, dm, kw["A"].shape[1], generator=_gen(500 + seed), dtype=F64).to(dtype)
    return state, step


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "device,dtype", _cases(("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"))
)
def test_selective_state_update(refs, seed, options, device, dtype):
    state, s = _mamba1_step(seed, dtype, options)
    ref_state = state.clone()
    y_ref = refs.selective_state_update_ref(
        ref_state,
        s["u"],
        s["delta"],
        s["A"],
        s["B"],
        s["C"],
        D=s["D"],
        z=s["z"],
        dt_bias=s["delta_bias"],
        dt_softplus=s["delta_softplus"],
    )
    before = state.to(device)
    y, new = selective_state_update(before, **_to(s, device))
    torch.testing.assert_close(before.cpu(), state, rtol=0, atol=0)  # ours never writes its input
    _close(y, y_ref, dtype, device, "y")
    _close(new, ref_state, dtype, device, "new state")


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_native_selective_scan_decode_step(refs, seed, options):
    """The Mamba block's CPU float32 decode step: hc_selective_scan with T = 1 and a state."""
    _need_native()
    state, s = _mamba1_step(seed, F32, options)
    ref_state = state.clone()
    y_ref = refs.selective_state_update_ref(
        ref_state,
        s["u"],
        s["delta"],
        s["A"],
        s["B"],
        s["C"],
        D=s["D"],
        z=s["z"],
        dt_bias=s["delta_bias"],
        dt_softplus=s["delta_softplus"],
    )
    one = {k: (v[:, None] if k in ("u", "delta", "z", "B", "C") and v is not None else v) for k, v in s.items()}
    with torch.no_grad():
        assert (
            cpu_kernels.selective_scan(
                one["u"],
                one["delta"],
                one["z"],
                one["B"],
                one["C"],
                s["A"],
                s["D"],
                s["delta_bias"],
                s["delta_softplus"],
                state,
            )
            is not None
        )
        y, new = selective_scan_btd(**one, state=state)
    _close(y[:, 0], y_ref, F32, what="y")
    _close(new, ref_state, F32, what="new state")


# --- causal conv -----------------------------------------------------------------------------------------------------


def _conv(seed: int, dtype: torch.dtype, k: int):
    g = _gen(1000 + seed)
    b, c, t = _ints(g, 1, 3), _ints(g, 1, 12), _ints(g, 1, 20)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)
    return r(b, c, t), r(c, k), r(c), r(b, c, k - 1)


def _seeded(cases: list, f64_seeds: int) -> list:
    """(seed, device, dtype) params: every seed in float32, the first `f64_seeds` in float64. The conv references'
    float64 depthwise F.conv1d takes ~0.2 s a call on CPU even at these sizes (float32: ~5 ms)."""
    return [
        pytest.param(seed, *c.values, id=f"{c.id}-{seed}", marks=c.marks)
        for c in cases
        for seed in SEEDS
        if c.values[1] == F32 or seed < f64_seeds
    ]


CONV_KERNELS = (("causal_conv1d", "causal_conv1d_fn"),)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("seed,device,dtype", _seeded(_cases(*CONV_KERNELS), f64_seeds=2))
def test_causal_conv1d(refs, seed, k, activation, device, dtype):
    x, w, bias, state = _conv(seed, dtype, k)
    # the drawn length, and lengths shorter than the width; fewer in float64 (see _seeded)
    lengths = (x.shape[-1], 1, k - 1) if dtype == F32 else (x.shape[-1], 1)
    combos = ((bias, state), (None, None), (bias, None), (None, state))
    for t in lengths:
        xs = x[..., :t]
        for b, s in combos if dtype == F32 else combos[:2]:
            y_ref, fin_ref = refs.causal_conv1d_ref(
                xs, w, b, initial_states=s, return_final_states=True, activation=activation
            )
            y, fin = causal_conv1d(*_to(dict(x=xs, w=w, b=b, s=s), device).values(), activation=activation)
            what = f"T={t} bias={b is not None} state={s is not None}"
            _close(y, y_ref, dtype, device, f"y {what}")
            _close(fin, fin_ref, dtype, device, f"final state {what}")


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("seed,device,dtype", _seeded(_cases(("causal_conv1d", "causal_conv1d_update")), f64_seeds=2))
def test_causal_conv1d_step(refs, seed, k, activation, device, dtype):
    """Five chained steps of ours vs causal_conv1d_update_ref on a state of K-1 columns (updated in place there)."""
    x, w, bias, state = _conv(seed, dtype, k)
    ref_state, ours = state.clone(), state.to(device)
    for i in range(min(5, x.shape[-1])):
        y_ref = refs.causal_conv1d_update_ref(x[..., i], ref_state, w, bias, activation=activation)
        before = ours.clone()
        y, ours_new = causal_conv1d_step(
            *_to(dict(x=x[..., i], w=w, b=bias), device).values(), ours, activation=activation
        )
        torch.testing.assert_close(ours, before, rtol=0, atol=0)  # never writes its input
        _close(y, y_ref, dtype, device, f"y step {i}")
        _close(ours_new, ref_state, dtype, device, f"state step {i}")
        ours = ours_new


# --- Mamba2 / SSD ----------------------------------------------------------------------------------------------------


def _mamba2(seed: int, dtype: torch.dtype, t: int | None = None):
    """x [B, T, H, P], dt [B, T, H] > 0, A [H] < 0, B / C [B, T, G, N], D / dt_bias [H], state [B, H, P, N]."""
    g = _gen(2000 + seed)
    bsz, groups, p, n = _ints(g, 1, 2), _ints(g, 1, 2), _ints(g, 1, 5), _ints(g, 1, 8)
    heads = groups * _ints(g, 1, 3)
    t = _ints(g, 1, 40) if t is None else t
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)
    dt = F.softplus(r(bsz, t, heads) - 1.0)
    return dict(
        x=r(bsz, t, heads, p),
        dt=dt,
        A=-torch.exp(r(heads) * 0.5),
        B=r(bsz, t, groups, n),
        C=r(bsz, t, groups, n),
        D=r(heads),
        dt_bias=r(heads) * 0.5,
        state=r(bsz, heads, p, n),
    )


def _minimal(refs, m: dict, block: int, state: torch.Tensor | None):
    """ssd_minimal_discrete's conventions: X = x dt, A = A dt per step, B / C per head, initial state
    [B, 1, H, P, N]."""
    heads = m["x"].shape[2]
    per_head = lambda v: repeat(v, "b t g n -> b t (g r) n", r=heads // v.shape[2])
    y, final = refs.ssd_minimal_discrete(
        m["x"] * m["dt"][..., None],
        m["A"] * m["dt"],
        per_head(m["B"]),
        per_head(m["C"]),
        block,
        None if state is None else state[:, None],
    )
    return y, final


def _divisor(t: int, seed: int) -> int:
    divisors = [d for d in range(1, t + 1) if t % d == 0]
    return divisors[seed % len(divisors)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("device,dtype", _cases(("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")))
def test_ssd_scan_vs_minimal(refs, seed, with_state, device, dtype):
    m = _mamba2(seed, dtype)
    t = m["x"].shape[1]
    state = m["state"] if with_state else None
    y_ref, final_ref = _minimal(refs, m, _divisor(t, seed), state)  # block_len must divide T there
    for chunk in sorted({1, 3, 5, 7, 16, t, t + 5}):  # ours: any chunk size, dividing T or not
        args = _to(dict(x=m["x"], dt=m["dt"], A=m["A"], B=m["B"], C=m["C"]), device)
        y, final = ssd_scan(**args, chunk_size=chunk, state=None if state is None else state.to(device))
        _close(y, y_ref, dtype, device, f"y chunk={chunk}")
        _close(final, final_ref, dtype, device, f"final state chunk={chunk}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit", [False, True], ids=["no-limit", "dt_limit"])
@pytest.mark.parametrize("device,dtype", _cases(("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")))
def test_ssd_scan_vs_chunk_scan_combined_ref(refs, seed, limit, device, dtype):
    """D, dt_bias, dt_softplus (and dt_limit, applied to dt before the reference, which has none). The reference needs
    a chunk size that divides T (its chunk_scan_ref asserts it); ours is run with chunk sizes that do not. It casts dt
    to float32 (`dt.float()`, "high precision before cumsum") whatever the input dtype, so float64 is compared at
    float32's tolerance here (test_ssd_scan_vs_minimal holds float64 to 1e-10)."""
    m = _mamba2(seed, dtype)
    t = m["x"].shape[1]
    dt_limit = (0.2, 0.9) if limit else (0.0, float("inf"))
    dt_ref, bias_ref, softplus_ref = m["dt"] - 0.5, m["dt_bias"], True
    if limit:
        dt_ref, bias_ref, softplus_ref = F.softplus(dt_ref + m["dt_bias"]).clamp(*dt_limit), None, False
    y_ref = refs.ssd_chunk_scan_combined_ref(
        m["x"], dt_ref, m["A"], m["B"], m["C"], _divisor(t, seed), D=m["D"], dt_bias=bias_ref, dt_softplus=softplus_ref
    )
    for chunk in sorted({4, 7, max(1, t - 1), t + 3}):
        args = _to(
            dict(x=m["x"], dt=m["dt"] - 0.5, A=m["A"], B=m["B"], C=m["C"], D=m["D"], dt_bias=m["dt_bias"]), device
        )
        y, _ = ssd_scan(**args, chunk_size=chunk, dt_softplus=True, dt_limit=dt_limit)
        _close(y, y_ref, F32, device, f"y chunk={chunk}")


def _mamba2_step(seed: int, dtype: torch.dtype):
    m = _mamba2(seed, dtype, t=1)
    return m["state"], dict(
        x=m["x"][:, 0], dt=m["dt"][:, 0] - 0.5, A=m["A"], B=m["B"][:, 0], C=m["C"][:, 0], D=m["D"], dt_bias=m["dt_bias"]
    )


def _step_ref(refs, state, s, dt_limit=None):
    """The multi-head selective_state_update_ref: per-head A / dt / D / dt_bias expanded over the head dim."""
    p, n = state.shape[2], state.shape[3]
    dt, bias, softplus = s["dt"], s["dt_bias"], True
    if dt_limit is not None:  # the reference has no dt_limit: hand it the processed dt
        dt, bias, softplus = F.softplus(dt + bias).clamp(*dt_limit), None, False
    new = state.clone()
    y = refs.selective_state_update_ref(
        new,
        s["x"],
        repeat(dt, "b h -> b h p", p=p),
        repeat(s["A"], "h -> h p n", p=p, n=n),
        s["B"],
        s["C"],
        D=repeat(s["D"], "h -> h p", p=p),
        dt_bias=None if bias is None else repeat(bias, "h -> h p", p=p),
        dt_softplus=softplus,
    )
    return y, new


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit", [False, True], ids=["no-limit", "dt_limit"])
@pytest.mark.parametrize(
    "device,dtype", _cases(("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"))
)
def test_ssd_step(refs, seed, limit, device, dtype):
    state, s = _mamba2_step(seed, dtype)
    dt_limit = (0.2, 0.9) if limit else None
    y_ref, new_ref = _step_ref(refs, state, s, dt_limit)
    before = state.to(device)
    y, new = ssd_step(before, **_to(s, device), dt_softplus=True, **({"dt_limit": dt_limit} if limit else {}))
    torch.testing.assert_close(before.cpu(), state, rtol=0, atol=0)
    _close(y, y_ref, dtype, device, "y")
    _close(new, new_ref, dtype, device, "new state")


# --- the CUDA dispatch glue, with the authors' references standing in for the kernels --------------------------------


@pytest.fixture
def refs_as_kernels(refs, monkeypatch):
    """Each op's `cuda_kernel` answers with the reference that has the kernel's signature (CPU tensors)."""
    stand_ins = {
        "selective_scan_fn": refs.selective_scan_ref,
        "selective_state_update": refs.selective_state_update_ref,
        "causal_conv1d_fn": refs.causal_conv1d_ref,
        "causal_conv1d_update": refs.causal_conv1d_update_ref,
    }
    calls: list[str] = []

    def fake(module, name, *tensors):
        if name not in stand_ins:
            return None  # mamba_chunk_scan_combined: no reference of that signature; the torch path runs
        calls.append(name)
        return stand_ins[name]

    for mod in (ss_mod, conv_mod, ssd_mod):
        monkeypatch.setattr(mod, "cuda_kernel", fake)
    return calls


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_glue_selective_scan(refs, refs_as_kernels, seed, options):
    """selective_scan_fn has no initial state: ours superposes its contribution (_with_initial_state)."""
    kw = _mamba1(seed, F32, options)
    h0 = torch.randn(kw["u"].shape[0], *kw["A"].shape, generator=_gen(600 + seed))
    y_ref, last_ref = _steps_ref(refs, kw, h0)
    y, last = selective_scan(**kw, state=h0)
    y0, last0 = selective_scan(**kw)
    assert refs_as_kernels == ["selective_scan_fn"] * 2
    _close(y, y_ref, F32, what="y")
    _close(last, last_ref, F32, what="last state")
    y0_ref, last0_ref = _steps_ref(refs, kw)
    _close(y0, y0_ref, F32, what="y (zero state)")
    _close(last0, last0_ref, F32, what="last state (zero state)")


@pytest.mark.parametrize("seed", SEEDS)
def test_glue_selective_state_update(refs, refs_as_kernels, seed):
    state, s = _mamba1_step(seed, F32, "all")
    ref_state = state.clone()
    y_ref = refs.selective_state_update_ref(
        ref_state,
        s["u"],
        s["delta"],
        s["A"],
        s["B"],
        s["C"],
        D=s["D"],
        z=s["z"],
        dt_bias=s["delta_bias"],
        dt_softplus=True,
    )
    before = state.clone()
    y, new = selective_state_update(state, **s)
    assert refs_as_kernels == ["selective_state_update"]
    torch.testing.assert_close(state, before, rtol=0, atol=0)
    _close(y, y_ref, F32, what="y")
    _close(new, ref_state, F32, what="new state")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit", [False, True], ids=["no-limit", "dt_limit"])
def test_glue_ssd_step(refs, refs_as_kernels, seed, limit):
    """The Mamba2 step through the kernel's tied-head-dim inputs (stride-0 A / dt / dt_bias, dt pre-processed)."""
    state, s = _mamba2_step(seed, F32)
    dt_limit = (0.2, 0.9) if limit else None
    y_ref, new_ref = _step_ref(refs, state, s, dt_limit)
    y, new = ssd_step(state, **s, dt_softplus=True, **({"dt_limit": dt_limit} if limit else {}))
    assert refs_as_kernels == ["selective_state_update"]
    _close(y, y_ref, F32, what="y")
    _close(new, new_ref, F32, what="new state")


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_glue_causal_conv1d(refs, refs_as_kernels, seed, k):
    """Prefill: the state prepended and the first K-1 outputs dropped; step: a width-K buffer updated in place."""
    x, w, bias, state = _conv(seed, F32, k)
    for s in (None, state):
        y_ref, fin_ref = refs.causal_conv1d_ref(
            x, w, bias, initial_states=s, return_final_states=True, activation="silu"
        )
        y, fin = causal_conv1d(x, w, bias, s, activation="silu")
        _close(y, y_ref, F32, what=f"y state={s is not None}")
        _close(fin, fin_ref, F32, what=f"final state state={s is not None}")
    ref_state = state.clone()
    y_ref = refs.causal_conv1d_update_ref(x[..., 0], ref_state, w, bias, activation="silu")
    y, new = causal_conv1d_step(x[..., 0], w, bias, state, activation="silu")
    assert refs_as_kernels == ["causal_conv1d_fn"] * 2 + ["causal_conv1d_update"]
    _close(y, y_ref, F32, what="step y")
    _close(new, ref_state, F32, what="step state")


# --- coverage of the native kernels ----------------------------------------------------------------------------------


def test_every_native_scan_kernel_is_compared():
    """Each kernel in cpu_decode.c for a scan, a state update or a conv has a comparison above (see NATIVE)."""
    source = "".join(p.read_text() for p in sorted(Path(cpu_kernels.SOURCE).parent.glob("*.c")))  # every family
    kernels = set(re.findall(r"^void (hc_\w+)\(", source, flags=re.MULTILINE))
    recurrent = {k for k in kernels if re.search(r"scan|ssd|state|conv|mamba|recurr|lru|delta", k)}
    assert recurrent == set(NATIVE), f"native kernels without a reference comparison here: {recurrent - set(NATIVE)}"
    for tests in NATIVE.values():
        for name in tests:  # a test here, or `module::test` in another file
            module, _, test = name.rpartition("::")
            assert hasattr(importlib.import_module(module), test) if module else name in globals(), name


def test_refs_import_leaves_sys_modules_alone(refs):
    """Where the CUDA extensions were stubbed, neither the stubs nor the modules imported over them stay in
    sys.modules: a later import (hybridcache's CUDA dispatch) gets the genuine ImportError."""
    import sys

    if not refs.stubbed:
        pytest.skip("the CUDA extensions are installed here: nothing was stubbed")
    # only the stubs: in a whole-suite run other code (transformers' kernel probes) may import the packages itself
    left = [k for k in sys.modules if k in mamba_refs.CUDA_EXTENSIONS and "stub" in repr(sys.modules[k]).lower()]
    assert left == []
    if "causal_conv1d" not in sys.modules:
        with pytest.raises(ImportError):
            importlib.import_module("causal_conv1d")

"""Randomized driver for every C kernel wrapper (hybridcache/accel/native/kernels.py, cpu_fused.py): odd shapes (0, 1,
odd, large state sizes, huge expanded dims), strides (non-contiguous, expanded, strided last dim), wrong dtypes and
devices (meta), NaN / inf values, bad parameters (chunk 0, unknown patterns, softcap <= 0).

Run as `python -m tests.ops.kernel_fuzz --seed S --cases N` (test_kernel_fuzz.py runs it in a subprocess: a signal
death there is a test failure, not a dead test session). Each case prints its description to stderr before it runs,
so the last line names the case that killed the process. Every case must end in one of:
- "declined": the wrapper returned None (the caller's torch path runs: nothing reached C);
- "named": it raised a named error (a ValueError subclass such as KernelArgumentError, or MemoryError);
- "equal": its result equals the float64 torch reference (same NaN / inf positions, finite values within float32
  rounding).
Anything else (another exception, a different result) is a "failure"; the summary is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import traceback

import torch
import torch.nn.functional as F

import hybridcache.accel.native.kernels as ck
from hybridcache.accel.native import decoder_layer as cpu_decoder_layer
from hybridcache.accel.native import decoder_stack as cpu_decoder_stack
from hybridcache.accel.native import fused as cpu_fused
from hybridcache.accel.native.steps import attention as cpu_attention_step
from hybridcache.ops.attention import masked_attention
from hybridcache.ops.selective_scan import _selective_scan_torch

SPECIALS = (float("nan"), float("inf"), float("-inf"))


class Fuzz:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.special = False

    def pick(self, *options):
        return self.rng.choice(options)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def values(self, shape, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
        """randn values (NaN / inf sprinkled in when this case is a special-values case), contiguous."""
        t = torch.randn(shape, generator=self.gen, dtype=torch.float64).mul_(scale)
        if self.special and t.numel():
            flat = t.view(-1)
            for _ in range(self.rng.randint(1, 3)):
                flat[self.rng.randrange(flat.numel())] = self.pick(*SPECIALS)
        return t.to(dtype)

    def layout(self, t: torch.Tensor) -> torch.Tensor:
        """The same values in another memory layout (any of: contiguous, strided last dim, strided outer dim,
        a permuted outer pair, an expanded size-1 dim)."""
        if t.dim() == 0 or t.numel() == 0:
            return t
        mode = self.pick("contiguous", "contiguous", "last", "outer", "permute", "expand")
        fill = float("nan") if t.dtype.is_floating_point else 0  # the gaps: garbage a kernel must not read
        if mode == "last":
            buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype)
            buf[..., ::2] = t
            return buf[..., ::2]
        if mode == "outer":
            buf = torch.full((2 * t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)
            buf[::2] = t
            return buf[::2]
        if mode == "permute" and t.dim() >= 3:
            return t.transpose(0, 1).contiguous().transpose(0, 1)
        if mode == "expand" and t.shape[0] > 1:
            return t[:1].expand(t.shape)
        return t

    def spoil(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Sometimes a wrong dtype or device for this argument."""
        if t is None or not self.chance(0.025):
            return t
        kind = self.pick(torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.bool, "meta")
        if kind == "meta":
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        return t.to(kind)


# ---- float64 references -------------------------------------------------------------------------------------------


def d64(t):
    return None if t is None else t.double()


def ref_norm(x, scale, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.double()


def ref_act(act, gate, up):
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def ref_rope(x, cos, sin, interleaved):
    x = x.double()
    b, _, t, _ = x.shape
    r = cos.shape[-1]
    c, s = cos.double().reshape(b, 1, t, r), sin.double().reshape(b, 1, t, r)
    head = x[..., :r]
    if interleaved:
        rot = torch.stack((-head[..., 1::2], head[..., ::2]), dim=-1).reshape(head.shape)
    else:
        rot = torch.cat((-head[..., r // 2 :], head[..., : r // 2]), dim=-1)
    return torch.cat((head * c + rot * s, x[..., r:]), dim=-1)


def ref_linear(x, w, bias, scale):
    out = x.double() @ w.double().T
    if scale is not None:
        out = out * scale.double()
    return out if bias is None else out + bias.double()


def visible(qpos, kpos, name, param):
    q, k = qpos.reshape(-1, 1), kpos
    ok = (q >= 0) & (k >= 0) & (k <= q)
    if name == "sliding":
        ok &= k > q - param
    elif name == "chunked":
        ok &= torch.div(k, param, rounding_mode="floor") == torch.div(q, param, rounding_mode="floor")
    return ok


# ---- one case per wrapper: (description, call, reference) ---------------------------------------------------------


def case_linear(f: Fuzz):
    rows, k, n = f.pick(0, 1, 2, 5, 16, 17), f.pick(0, 1, 3, 8, 17, 64), f.pick(0, 1, 5, 33)
    lead = f.pick((rows,), (1, rows), (rows, 1))
    fmt = f.pick(torch.float32, torch.bfloat16, torch.int8)
    x = f.spoil(f.layout(f.values((*lead, k))))
    if fmt == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=f.gen, dtype=torch.int8)
    else:
        w = f.values((n, k), 0.3).to(fmt)
    w = f.spoil(f.layout(w) if f.chance(0.2) else w)
    bias = f.spoil(f.values((n,))) if f.chance(0.5) else None
    scale = f.spoil(f.values((n,), 0.01)) if f.chance(0.5) else None
    desc = (
        f"decode_linear x{tuple(x.shape)} {x.dtype} w{tuple(w.shape)} {w.dtype} bias={bias is not None} "
        f"scale={scale is not None}"
    )
    return (desc, lambda: ck.decode_linear(x, w, bias, scale), lambda: ref_linear(x, w, bias, scale))


def case_rms_norm(f: Fuzz):
    d = f.pick(0, 1, 3, 16, 70)
    x = f.spoil(f.layout(f.values((*f.pick((), (0,), (1,), (3,), (2, 5)), d), 3.0)))
    scale = f.spoil(f.values((d,))) if f.chance(0.95) else f.values((d + 1,))
    eps = f.pick(1e-6, 1e-2, 0.0)
    return (
        f"rms_norm x{tuple(x.shape)} {x.dtype} eps={eps}",
        lambda: ck.rms_norm(x, scale, eps),
        lambda: ref_norm(x, scale, eps),
    )


def case_residual_norm(f: Fuzz):
    d = f.pick(0, 1, 3, 16, 70)
    shape = (*f.pick((1,), (3,), (2, 5), (0,)), d)
    h, x = f.spoil(f.layout(f.values(shape, 3.0))), f.spoil(f.layout(f.values(shape, 2.0)))
    post = (f.spoil(f.values((d,))), 1e-6) if f.chance(0.5) else None
    nxt = (f.spoil(f.values((d,))), 1e-2) if f.chance(0.5) else None

    def ref():
        s = h.double() + (ref_norm(x, *post) if post else x.double())
        return (s, ref_norm(s.float(), *nxt) if nxt else None)  # the second norm reads the float32 sum

    return (
        f"residual_norm {tuple(shape)} post={post is not None} next={nxt is not None}",
        lambda: ck.residual_norm(h, x, post, nxt),
        ref,
    )


def case_act_mul(f: Fuzz):
    inner = f.pick(0, 1, 3, 16, 70)
    act = f.pick(*ck.ACT_MUL, "relu")
    two = 2 * inner + (1 if f.chance(0.05) else 0)
    gu = f.spoil(f.layout(f.values((*f.pick((1,), (4,), (2, 3)), two), 4.0)))
    ref = lambda: ref_act(act, *gu.double().chunk(2, dim=-1))
    return f"act_mul {tuple(gu.shape)} {gu.dtype} {act}", lambda: ck.act_mul(gu, act), ref


def case_argmax(f: Fuzz):
    rows, v = f.pick(0, 1, 3), f.pick(0, 1, 7, 40, 1 << 15)
    x = f.spoil(f.layout(f.values((rows, v))))
    if f.chance(0.05):
        x = torch.zeros(1, 1).expand(1, 2**31)  # a huge (expanded) row: declined, never copied
    return f"argmax_rows {tuple(x.shape)} {x.dtype}", lambda: ck.argmax_rows(x), lambda: torch.argmax(x, dim=-1)


def case_attention(f: Fuzz):
    b, hkv, group = f.pick(0, 1, 1, 2, 3), f.pick(0, 1, 1, 2, 2), f.pick(1, 2, 3)
    s, d = f.pick(0, 1, 5, 40, 40, 700), f.pick(0, 1, 7, 16, 64, 64)
    hq = hkv * group if hkv else group
    q = f.spoil(f.layout(f.values((b, hq, 1, d))))
    if f.chance(0.5):  # keys and values as strided views of one tensor, as a cache holds them
        kv = f.values((b, hkv, s, 2 * d))
        k, v = kv[..., :d], kv[..., d:]
    else:
        k, v = f.layout(f.values((b, hkv, s, d))), f.layout(f.values((b, hkv, s, d)))
    scale, softcap = f.pick(d**-0.5 if d else 1.0, 0.3), f.pick(None, None, None, 5.0, 5.0, 0.0, -1.0)
    kpos = torch.arange(s).repeat(b, 1) - torch.randint(0, 3, (b, 1), generator=f.gen)  # left padding: -1, -2
    qpos = kpos[:, -1:].clone() if s else torch.zeros(b, 1, dtype=torch.long)
    if b and f.chance(0.2):
        qpos[0] = -1  # a padding query sees nothing
    if f.chance(0.5):
        name = f.pick("full", "sliding", "sliding", "chunked", "chunked", "chunked", "ring")
        param = f.pick(-1, 0, 1, 3, 3, 7, 7, 2**40)
        positions, mask = (f.spoil(qpos), f.spoil(kpos), name, param), None
        desc = f"positions {name} {param}"

        def ref_mask():
            return (
                visible(qpos, kpos, name, param)[:, None]
                if name in ck.PATTERNS and param >= 1 or name == "full"
                else None
            )
    else:
        mask = torch.rand(b, 1, s, generator=f.gen) < f.pick(0.0, 0.3, 1.0)
        positions, desc = None, f"mask p={mask.float().mean().item() if mask.numel() else 0:.2f}"
        ref_mask = lambda: mask
        if mask.numel() and f.chance(0.5):  # garbage in hidden slots stays hidden
            k = k.masked_fill(~mask[..., None], float("nan"))
    k, v = f.spoil(k), f.spoil(v)
    sinks = f.spoil(f.values((hq,), 3.0)) if f.chance(0.4) else None  # learned sink logits (GPT-OSS)

    def ref():
        m = ref_mask()
        sk = None if sinks is None else sinks.double()
        return masked_attention(q.double(), k.double(), v.double(), m.reshape(b, 1, s), scale, softcap, sinks=sk)

    return (
        f"decode_attention q{tuple(q.shape)} {q.dtype} k{tuple(k.shape)} {k.dtype} {desc} softcap={softcap} "
        f"sinks={None if sinks is None else sinks.dtype}",
        lambda: ck.decode_attention(q, k, v, mask, scale, softcap, positions=positions, sinks=sinks),
        ref,
    )


def _cos_sin(f: Fuzz, b, t, d):
    r = f.pick(0, 2, d - d % 2, d - d % 2, d - d % 2, d + 2, 3)
    ang = f.values((b, 1, t, max(r, 0)))
    cos, sin = f.spoil(ang.cos()), f.spoil(ang.sin())
    return cos, sin, r


def case_rope(f: Fuzz):
    b, h, t, d = f.pick(0, 1, 2, 2), f.pick(1, 3), f.pick(0, 1, 5, 5), f.pick(0, 2, 8, 9, 64, 64)
    x = f.spoil(f.layout(f.values((b, h, t, d))))
    if f.chance(0.05):
        x = torch.zeros(1, 1, 1, 4096).expand(1 << 20, 1, 1, 4096)  # 2**32 elements, expanded: declined
        b, t = x.shape[0], 1
    cos, sin, r = _cos_sin(f, b, t, d) if b * t < 4096 else (torch.ones(1), torch.ones(1), 1)
    interleaved = f.chance(0.5)
    return (
        f"rope x{tuple(x.shape)} {x.dtype} r={r} interleaved={interleaved}",
        lambda: ck.rope(x, cos, sin, interleaved),
        lambda: ref_rope(x, cos, sin, interleaved),
    )


def case_norm_rope(f: Fuzz):
    b, h, t, d = f.pick(0, 1, 2, 2), f.pick(1, 3), f.pick(0, 1, 5, 5), f.pick(1, 2, 8, 9, 64)
    x = f.spoil(f.layout(f.values((b, h, t, d))))
    scale = f.spoil(f.values((d,))) if f.chance(0.7) else None
    cos, sin, r = _cos_sin(f, b, t, d) if f.chance(0.7) else (None, None, 0)
    interleaved, eps = f.chance(0.5), 1e-6

    def ref():
        y = ref_norm(x, scale, eps) if scale is not None else x.double()
        return ref_rope(y, cos, sin, interleaved) if cos is not None else y

    return (
        f"norm_rope x{tuple(x.shape)} {x.dtype} norm={scale is not None} r={r}",
        lambda: ck.norm_rope(x, scale, eps, cos, sin, interleaved),
        ref,
    )


def case_scan(f: Fuzz):
    b, t, dm, n = f.pick(0, 1, 2, 2), f.pick(0, 1, 3, 9), f.pick(0, 1, 5, 16, 16), f.pick(0, 1, 5, 16, 21)
    if f.chance(0.08):  # a large state: 16 MiB of state per channel (was a stack array: SIGSEGV)
        b, t, dm, n = 1, f.pick(1, 2), 1, 1 << 22
    u = f.spoil(f.layout(f.values((b, t, dm))))
    delta = f.spoil(f.layout(f.values((b, t, dm), 0.5)))
    z = f.spoil(f.layout(f.values((b, t, dm)))) if f.chance(0.5) else None
    bm, cm = f.spoil(f.layout(f.values((b, t, n)))), f.spoil(f.layout(f.values((b, t, n))))
    a = f.spoil(-torch.exp(f.values((dm, n), 0.5)))
    optional = f.chance(0.5)
    d, bias, state = (
        (f.spoil(f.values((dm,))), f.spoil(f.values((dm,))), f.spoil(f.layout(f.values((b, dm, n)))))
        if optional
        else (None, None, None)
    )
    softplus = f.chance(0.5)

    def ref():
        tr = lambda v: None if v is None else v.transpose(1, 2).double()
        y, last = _selective_scan_torch(
            tr(u), tr(delta), a.double(), tr(bm), tr(cm), d64(d), tr(z), d64(bias), softplus, d64(state)
        )
        return y.transpose(1, 2), last

    return (
        f"selective_scan u{tuple(u.shape)} {u.dtype} n={n} optional={optional} z={z is not None}",
        lambda: ck.selective_scan(u, delta, z, bm, cm, a, d, bias, softplus, state),
        ref,
        n,
    )


def _weight(f: Fuzz, n, k):
    fmt = f.pick(torch.float32, torch.bfloat16, torch.int8)
    if fmt == torch.int8:
        w, scale = torch.randint(-127, 128, (n, k), generator=f.gen, dtype=torch.int8), f.values((n,), 0.01)
    else:
        w, scale = f.values((n, k), 0.3).to(fmt), (f.values((n,)) if f.chance(0.3) else None)
    bias = f.values((n,)) if f.chance(0.3) else None
    return f.spoil(w), f.spoil(bias), f.spoil(scale)


def case_gated_mlp(f: Fuzz):
    rows, d, i = f.pick(0, 1, 3, 3, 16, 17), f.pick(0, 1, 8, 24, 24), f.pick(0, 1, 5, 32, 32)
    x = f.spoil(f.layout(f.values((rows, d))))
    gu, dn = _weight(f, 2 * i, d), _weight(f, d, i)
    act = f.pick(*cpu_fused.ACT_MUL, "relu")

    def ref():
        g = ref_linear(x, gu[0], gu[1], gu[2])
        return ref_linear(ref_act(act, *g.chunk(2, dim=-1)), dn[0], dn[1], dn[2])

    return (
        f"gated_mlp x{tuple(x.shape)} {x.dtype} d={d} i={i} {gu[0].dtype}/{dn[0].dtype} {act}",
        lambda: cpu_fused.gated_mlp(x, gu, dn, act),
        ref,
    )


def case_qkv(f: Fuzz):
    b, t, dm = f.pick(0, 1, 1, 2), f.pick(1, 3, 3, 9), f.pick(0, 1, 16, 16)
    hq, hkv, hd = f.pick(1, 2, 4), f.pick(1, 2), f.pick(1, 2, 8, 9)
    width = (hq + 2 * hkv) * hd
    x = f.spoil(f.layout(f.values((b, t, dm))))
    w, bias, wscale = _weight(f, width, dm)
    q_norm = (f.spoil(f.values((hd,))), 1e-6) if f.chance(0.5) else None
    k_norm = (f.spoil(f.values((hd,))), 1e-6) if f.chance(0.5) else None
    cos, sin, r = _cos_sin(f, b, t, hd) if f.chance(0.7) else (None, None, 0)
    interleaved = f.chance(0.5)
    heads = f.pick(hq, hq, hq, 0, -1)
    in_norm = (f.spoil(f.values((dm,))), 1e-5) if f.chance(0.4) else None

    def ref():
        proj = ref_linear(x if in_norm is None else ref_norm(x, *in_norm).float(), w, bias, wscale)  # [B, T, W]
        out = []
        for h0, h1, norm in ((0, hq, q_norm), (hq, hq + hkv, k_norm)):
            y = proj[..., h0 * hd : h1 * hd].reshape(b, t, h1 - h0, hd).transpose(1, 2)
            y = ref_norm(y, *norm) if norm is not None else y
            out.append(ref_rope(y, cos, sin, interleaved) if cos is not None else y)
        out.append(proj[..., (hq + hkv) * hd :].reshape(b, t, hkv, hd).transpose(1, 2))
        return tuple(out)

    return (
        f"qkv_norm_rope x{tuple(x.shape)} {x.dtype} heads={heads}/{hq},{hkv},{hd} {w.dtype} r={r} "
        f"in_norm={in_norm is not None}",
        lambda: cpu_fused.qkv_norm_rope(
            x, (w, bias, wscale), heads, hkv, hd, q_norm, k_norm, cos, sin, interleaved, in_norm
        ),
        ref,
    )


def _tail_ref(h, a, o, norms, gu, dn, act):
    """decoder_tail in float64 (norms: post_attn, pre_mlp, post_mlp, each (scale, eps) or None)."""

    def add(base, y, norm):  # the residual add, reading the float32 values the kernel reads
        return base.double() + (ref_norm(y.float(), *norm) if norm else y.double())

    h1 = add(h, ref_linear(a, *o), norms[0])
    x = ref_norm(h1.float(), *norms[1]) if norms[1] else h1
    g = ref_linear(x.float(), *gu)
    m = ref_linear(ref_act(act, *g.chunk(2, dim=-1)).float(), *dn)
    return add(h1, m, norms[2])


def case_decoder_tail(f: Fuzz):
    rows, d = f.pick(0, 1, 3, 3, 16, 17), f.pick(0, 1, 8, 24, 24)
    width, i = f.pick(0, 1, 12, 12), f.pick(0, 1, 5, 32, 32)
    lead = f.pick((rows,), (1, rows))
    h, a = f.spoil(f.layout(f.values((*lead, d), 2.0))), f.spoil(f.layout(f.values((*lead, width))))
    o, gu, dn = _weight(f, d, width), _weight(f, 2 * i, d), _weight(f, d, i)
    norms = [(f.spoil(f.values((d,))), 1e-6) if f.chance(0.6) else None for _ in range(3)]
    act = f.pick(*cpu_fused.ACT_MUL, "relu")

    def ref():
        return _tail_ref(h, a, o, norms, gu, dn, act)

    return (
        f"decoder_tail {tuple(h.shape)}/{tuple(a.shape)} i={i} {o[0].dtype}/{gu[0].dtype}/{dn[0].dtype} {act} "
        f"norms={[n is not None for n in norms]}",
        lambda: cpu_fused.decoder_tail(h, a, o, norms[0], norms[1], gu, dn, act, norms[2]),
        ref,
        max(width, d, i),
    )


def _unchanged(t: torch.Tensor, before: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    return torch.equal(t.nan_to_num(), before.nan_to_num()) if t.is_floating_point() else torch.equal(t, before)


def case_attention_step(f: Fuzz, tail: bool = False, stack: bool = False):
    """The one-call attention (tail=False) or the whole layer (tail=True: the decoder tail after it; stack=True:
    as a record run by the many-layer call, accel/native/decoder_stack.py)."""
    b, dm, s = f.pick(0, 1, 1, 2, 2, 17), f.pick(0, 1, 16, 16), f.pick(0, 1, 5, 40, 40, 40)
    hkv, group, hd = f.pick(1, 1, 2), f.pick(1, 2, 3), f.pick(1, 2, 8, 9)
    hq = hkv * group
    width = (hq + 2 * hkv) * hd
    x = f.spoil(f.layout(f.values((b, 1, dm))))
    w, bias, wscale = _weight(f, width, dm)
    q_norm = (f.spoil(f.values((hd,))), 1e-6) if f.chance(0.5) else None
    k_norm = (f.spoil(f.values((hd,))), 1e-6) if f.chance(0.5) else None
    in_norm = (f.spoil(f.values((dm,))), 1e-5) if f.chance(0.4) else None
    cos, sin, r = _cos_sin(f, b, 1, hd) if f.chance(0.7) else (None, None, 0)
    interleaved = f.chance(0.5)
    if f.chance(0.5):  # keys and values as strided views of one tensor, as a cache's buffers hold them
        kv = f.values((b, hkv, s, 2 * hd))
        keys, values = kv[..., :hd], kv[..., hd:]
    else:
        keys, values = f.values((b, hkv, s, hd)), f.values((b, hkv, s, hd))
    keys, values = f.spoil(keys), f.spoil(values)
    slot = f.pick(s - 1, s - 1, s - 1, s - 1, 0, s, -1)
    kpos = torch.arange(s).repeat(b, 1) - torch.randint(0, 3, (b, 1), generator=f.gen)  # left padding: -1, -2
    qpos = kpos[:, -1:].clone() if s else torch.zeros(b, 1, dtype=torch.long)
    name, param = f.pick("full", "sliding", "chunked", "chunked", "ring"), f.pick(0, 1, 3, 7, 7, 2**40)
    scale, softcap = f.pick(hd**-0.5, 0.3), f.pick(None, None, 5.0, 0.0)
    sinks = f.spoil(f.values((hq,), 3.0)) if f.chance(0.3) else None
    before = (keys.clone(), values.clone())
    i = f.pick(0, 1, 5, 32)
    o, gu, dn = _weight(f, dm, hq * hd), _weight(f, 2 * i, dm), _weight(f, dm, i)
    norms = [(f.spoil(f.values((dm,))), 1e-6) if f.chance(0.6) else None for _ in range(3)]
    act = f.pick(*cpu_fused.ACT_MUL, "relu")

    def run():
        step = ((w, bias, wscale), hq, hkv, hd, q_norm, k_norm, interleaved, in_norm, scale, softcap, sinks)
        per_call = (cos, sin, keys, values, slot, qpos, kpos, name, param)
        if stack:
            out = _stacked(x, step, (o, norms[0], norms[1], gu, dn, act, norms[2]), per_call)
        elif tail:
            out = cpu_decoder_layer.decoder_layer(x, step, (o, norms[0], norms[1], gu, dn, act, norms[2]), per_call)
        else:
            out = cpu_attention_step.attention_step(
                x, *step[:6], cos, sin, interleaved, in_norm, *per_call[2:], *step[8:]
            )
        if out is None or not 0 <= slot < s:  # declined (a slot outside, say): nothing may have been written
            return out if _unchanged(keys, before[0]) and _unchanged(values, before[1]) else "written"
        return out, keys[:, :, slot], values[:, :, slot]

    def ref():
        proj = ref_linear(x if in_norm is None else ref_norm(x, *in_norm).float(), w, bias, wscale)  # [B, 1, W]
        qk = []
        for h0, h1, norm in ((0, hq, q_norm), (hq, hq + hkv, k_norm)):
            y = proj[..., h0 * hd : h1 * hd].reshape(b, 1, h1 - h0, hd).transpose(1, 2)
            y = ref_norm(y, *norm) if norm is not None else y
            qk.append(ref_rope(y, cos, sin, interleaved) if cos is not None else y)
        v_new = proj[..., (hq + hkv) * hd :].reshape(b, 1, hkv, hd).transpose(1, 2)
        kk, vv = before[0].double(), before[1].double()
        kk[:, :, slot], vv[:, :, slot] = qk[1][:, :, 0].float(), v_new[:, :, 0].float()  # what the cache holds
        seen = visible(qpos, kpos, name, param)[:, None].reshape(b, 1, s)
        sk = None if sinks is None else sinks.double()
        out = masked_attention(qk[0].float().double(), kk, vv, seen, scale, softcap, sinks=sk).reshape(b, 1, hq * hd)
        if tail:
            out = _tail_ref(x, out.float(), o, norms, gu, dn, act)
        return out, qk[1][:, :, 0], v_new[:, :, 0]

    return (
        f"{'decoder_stack' if stack else 'decoder_layer' if tail else 'attention_step'} i={i} {act} "
        f"x{tuple(x.shape)} {x.dtype} "
        f"heads={hq},{hkv},{hd} {w.dtype} s={s} slot={slot} {name} "
        f"{param} r={r} in_norm={in_norm is not None} softcap={softcap} sinks={sinks is not None}",
        run,
        ref,
        max(dm, s, hd, i, hq * hd),
    )


def _stacked(x, step_args: tuple, tail_args: tuple, per_call: tuple):
    """The whole layer bound as the model binds it, its record run by hc_decoder_stack into a fresh output."""
    if x.dim() != 3:
        return None
    qkv, heads, kv_heads, head_dim, *rest = step_args
    step = cpu_attention_step.bind_attention_step(qkv, heads, kv_heads, head_dim, x.shape[2], *rest)
    tail = cpu_fused.bind_decoder_tail(x.shape[2], heads * head_dim, *tail_args) if step is not None else None
    run = cpu_decoder_layer.bind_decoder_layer(step, tail)
    if run is None:
        return None
    y = torch.empty(x.shape[0], 1, x.shape[2])
    recorded = run.record(x, y, *per_call)
    if recorded is None:
        return None
    cpu_decoder_stack.call_records([recorded[0]])
    return y


_MODELS: dict = {}


def _gemma(weights):
    """A tiny random Gemma 3 (its every layer records: decode runs apply), built once per weight format into a
    temporary directory."""
    if weights not in _MODELS:
        import tempfile

        import hybridcache as hc
        from hybridcache.checkpoints.tiny import tiny_checkpoint

        root = _MODELS.setdefault("root", tempfile.mkdtemp(prefix="hc_fuzz_"))
        _MODELS[weights] = hc.from_pretrained(tiny_checkpoint("gemma3", root=root), weights=weights)
    return _MODELS[weights]


def case_decode_steps(f: Fuzz):
    """DecodeRun.greedy (kernels/cpu_decode.c hc_decode_steps: many greedy steps in one call) on a run of a random
    capacity (<= 0: no run, declined), from odd first tokens, step counts and eos ids; the reference: the same
    tokens fed one block at a time through the model's forward on a copy of the cache, argmax each."""
    import copy

    import hybridcache as hc
    from hybridcache.accel.runs import decode_run, layer_records

    weights = f.pick(None, "bfloat16", "int8")
    model = _gemma(weights)
    vocab = model.vocab_size
    prompt = torch.randint(3, vocab, (1, f.rng.randint(1, 12)), generator=f.gen)
    cache = hc.generate(model, prompt, max_new_tokens=1, output_logits=False).cache
    capacity = f.pick(-1, 0, 1, 2, 5, 17, 17)
    first = int(torch.randint(0, vocab, (1,), generator=f.gen))
    if f.chance(0.3):
        first = f.pick(-1, vocab, vocab + 7, True, 2.5)
    k = f.pick(1, 2, 4, capacity, capacity) if f.chance(0.75) else f.pick(capacity + 1, 0, -2, 1.0)
    eos = [f.rng.randrange(vocab) if f.chance(0.8) else f.pick(-1, 2**63, 7.0) for _ in range(f.rng.randint(0, 3))]
    keep = f.chance(0.5)
    desc = f"decode_steps {weights} capacity={capacity} first={first!r} k={k!r} eos={eos!r} keep={keep}"
    twin = copy.deepcopy(cache)

    def call():
        with layer_records.steady():
            ids = torch.tensor([[first if type(first) is int and 0 <= first < vocab else 3]])
            run = decode_run.DecodeRun.start(model, cache, capacity, ids, model.embed(ids))
            if run is None:
                return None
            try:
                return run.greedy(model, first, k, eos, keep)[0]
            finally:
                run.abandon()  # (the cache as it was: the next case's reference starts from there)

    def ref():
        tokens, token = [], first
        for _ in range(k):
            logits = model(torch.tensor([[token]]), twin)[:, -1]
            token = int(logits.argmax(-1))
            tokens.append(token)
            if token in eos:
                break
        return torch.tensor(tokens, dtype=torch.int64)

    return desc, call, ref


CASES = {
    "decode_linear": case_linear,
    "rms_norm": case_rms_norm,
    "residual_norm": case_residual_norm,
    "act_mul": case_act_mul,
    "argmax_rows": case_argmax,
    "decode_attention": case_attention,
    "rope": case_rope,
    "norm_rope": case_norm_rope,
    "selective_scan": case_scan,
    "gated_mlp": case_gated_mlp,
    "qkv_norm_rope": case_qkv,
    "decoder_tail": case_decoder_tail,
    "attention_step": case_attention_step,
    "decoder_layer": lambda f: case_attention_step(f, tail=True),
    "decoder_stack": lambda f: case_attention_step(f, tail=True, stack=True),
}
# Run on their own (`--only`: a model per case is slower than a kernel call; apart, they leave the cycle above and
# its random stream as they were)
MODEL_CASES = {"decode_steps": case_decode_steps}

TURNS = {"decoder_layer": 2, "decoder_stack": 2}

# ---- comparison ---------------------------------------------------------------------------------------------------


def same(got, want, terms: int = 1) -> str | None:
    """None if got (float32 / int64) equals the float64 reference: same shape, non-finite values in the same places,
    finite values within float32 rounding of sums of `terms` terms; else what differs. (NaN against +-inf counts as
    equal: 0 * inf gives NaN where float32 rounds a tiny product to 0 and float64 does not, e.g. silu(-100) * inf.)"""
    if isinstance(want, tuple) or isinstance(got, tuple):
        if not (isinstance(got, tuple) and isinstance(want, tuple)) or len(got) != len(want):
            return f"structure {type(got)} vs {type(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if (g is None) != (w is None):
                return f"part {i}: None vs tensor"
            why = None if g is None else same(g, w, terms)
            if why:
                return f"part {i}: {why}"
        return None
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if not got.dtype.is_floating_point:
        return None if torch.equal(got, want) else f"{got.tolist()} vs {want.tolist()}"
    g, w = got.double(), want.double()
    if not torch.equal(g.isfinite(), w.isfinite()):
        return f"finite vs NaN / inf at {int((g.isfinite() != w.isfinite()).sum())} places"
    fin = g.isfinite()
    if fin.any():
        top = w[fin].abs().max().item()
        err = (g[fin] - w[fin]).abs()
        tol = 2e-4 * max(1.0, math.sqrt(terms) / 16) * (w[fin].abs() + top + 1.0)
        if bool((err > tol).any()):
            return f"max error {err.max().item():.3g} (largest value {top:.3g})"
    return None


def run(seed: int, cases: int, only: str | None, start: int = 0) -> dict:
    f = Fuzz(seed)
    # the whole-layer cases reach their kernel least often (any of a dozen odd arguments declines): twice the turns
    names = [only] if only else [n for n in CASES for _ in range(TURNS.get(n, 1))]
    counts = {"cases": 0, "declined": 0, "named": 0, "equal": 0, "failures": []}
    per = {name: {"declined": 0, "named": 0, "equal": 0} for name in dict.fromkeys(names)}
    with torch.no_grad():
        for i in range(cases):
            name = names[i % len(names)]
            f.special = f.chance(0.3)
            desc, call, ref, *terms = {**CASES, **MODEL_CASES}[name](f)
            desc = f"#{i} {desc}{' specials' if f.special else ''}"
            if i < start:  # generated (the same random stream), not run: resume after a case that killed a run
                continue
            print(desc, file=sys.stderr, flush=True)
            counts["cases"] += 1
            try:
                got = call()
            except (ValueError, MemoryError) as e:
                outcome, detail = "named", f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - anything else is a failure to report
                outcome, detail = "failure", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
            else:
                if got is None:
                    outcome, detail = "declined", ""
                else:
                    try:
                        why = same(got, ref(), *terms)
                    except Exception as e:  # noqa: BLE001
                        why = f"the reference raised {type(e).__name__}: {e}"
                    outcome, detail = ("equal", "") if why is None else ("failure", why)
            if outcome == "failure":
                counts["failures"].append(f"{desc}: {detail}")
                print(f"FAILURE {desc}: {detail.splitlines()[0] if detail else ''}", file=sys.stderr, flush=True)
            else:
                counts[outcome] += 1
                per[name][outcome] += 1
    counts["per_wrapper"] = per
    counts["status"] = ck.kernel_status()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=720)
    parser.add_argument("--only", choices=sorted({**CASES, **MODEL_CASES}))
    parser.add_argument("--start", type=int, default=0, help="run cases from this index on")
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.cases, args.only, args.start)), flush=True)


if __name__ == "__main__":
    main()

"""Every op of op_declarations.DECLARATIONS as a `hybridcache::<name>` torch op: a CPU kernel (the declared rules
checked first,
KernelArgumentError naming the rule; then the C kernel through its eager wrapper, or the pure-torch reference where
the kernel does not take the arguments or is not built) and a fake implementation (the reference run on fake
tensors), so torch.compile traces each as one opaque call without graph breaks, and the compiled graph runs the
same kernels as eager code.

Ops are defined with the plain Library API: torch.library.custom_op would wrap each call in autograd and aliasing
checks (~10% of a compiled Gemma 3 270M decode step, measured for packed_linear in nn/core/linear.py). They have no
backward: call them without autograd (decode). Outputs are contiguous (what the fakes promise).
"""

from __future__ import annotations

import inspect

import torch

from hybridcache.accel.native import attention as cpu_attention
from hybridcache.accel.native import decoder_layer as cpu_decoder_layer
from hybridcache.accel.native import fused as cpu_fused
from hybridcache.accel.native import op_reference as reference
from hybridcache.accel.native import rows as cpu_rows
from hybridcache.accel.native.checks import INT_MAX, KernelArgumentError
from hybridcache.accel.native.op_declarations import DECLARATIONS, OpDeclaration, parse_rule
from hybridcache.accel.native.steps import attention as cpu_attention_step


def _kernel_calls() -> dict:
    """op name -> the eager wrapper called with the op's flat arguments (None: the kernel does not take them)."""

    def residual(h, x, ps, pe, ns, ne):
        out = cpu_rows.residual_norm(h, x, None if ps is None else (ps, pe), None if ns is None else (ns, ne))
        return out if out is None or out[1] is not None else (out[0], h.new_empty(0))

    def attention(q, k, v, mask, qpos, kpos, pattern, param, scale, softcap, sinks=None):
        positions = None if mask is not None else (qpos, kpos, pattern, param)
        return cpu_attention.decode_attention(q, k, v, mask, scale, softcap, positions, sinks)

    def qkv(x, w, bias, ws, heads, kv, hd, qs, qe, ks, ke, cos, sin, il, in_scale=None, in_eps=0.0):
        qn, kn = None if qs is None else (qs, qe), None if ks is None else (ks, ke)
        inn = None if in_scale is None else (in_scale, in_eps)
        out = cpu_fused.qkv_norm_rope(x, (w, bias, ws), heads, kv, hd, qn, kn, cos, sin, il, inn)
        return out if out is None else (out[0], out[1], out[2].contiguous())

    def step(x, w, bias, ws, heads, kv, hd, qs, qe, ks, ke, cos, sin, il, in_scale, in_eps, *attention):
        qn, kn = None if qs is None else (qs, qe), None if ks is None else (ks, ke)
        inn = None if in_scale is None else (in_scale, in_eps)
        return cpu_attention_step.attention_step(x, (w, bias, ws), heads, kv, hd, qn, kn, cos, sin, il, inn, *attention)

    def layer(*args):
        x, w, bias, ws, heads, kv, hd, qs, qe, ks, ke, cos, sin, il, in_scale, in_eps = args[:16]
        keys, values, slot, qpos, kpos, pattern, param, scale, softcap, sinks = args[16:26]
        wo, bo, so, pa, pae, pm, pme, wg, bg, sg, wd, bd, sd, act, po, poe = args[26:]
        qn, kn = None if qs is None else (qs, qe), None if ks is None else (ks, ke)
        norm = lambda s, e: None if s is None else (s, e)  # noqa: E731
        return cpu_decoder_layer.decoder_layer(
            x,
            ((w, bias, ws), heads, kv, hd, qn, kn, il, norm(in_scale, in_eps), scale, softcap, sinks),
            ((wo, bo, so), norm(pa, pae), norm(pm, pme), (wg, bg, sg), (wd, bd, sd), act, norm(po, poe)),
            (cos, sin, keys, values, slot, qpos, kpos, pattern, param),
        )

    return {
        "decode_linear": cpu_rows.decode_linear,
        "decode_linear_q8_0": cpu_rows.decode_linear_q8_0,
        "rms_norm": cpu_rows.rms_norm,
        "residual_norm": residual,
        "act_mul": cpu_rows.act_mul,
        "argmax_rows": cpu_rows.argmax_rows,
        "decode_attention": attention,
        "rope": cpu_attention.rope,
        "norm_rope": cpu_attention.norm_rope,
        "selective_scan": cpu_attention.selective_scan,
        "gated_mlp": lambda x, wg, bg, sg, wd, bd, sd, act: cpu_fused.gated_mlp(x, (wg, bg, sg), (wd, bd, sd), act),
        "qkv_norm_rope": qkv,
        "attention_step": step,
        "decoder_layer": layer,
        "decoder_tail": lambda h, a, wo, bo, so, pa, pae, pm, pme, wg, bg, sg, wd, bd, sd, act, po, poe: (
            cpu_fused.decoder_tail(
                h,
                a,
                (wo, bo, so),
                None if pa is None else (pa, pae),
                None if pm is None else (pm, pme),
                (wg, bg, sg),
                (wd, bd, sd),
                act,
                None if po is None else (po, poe),
            )
        ),
    }


KERNELS = _kernel_calls()
REFERENCES = {decl.name: getattr(reference, decl.name) for decl in DECLARATIONS}


def make_checker(decl: OpDeclaration):
    """The declared rules of `decl` as a function of the op's arguments that raises KernelArgumentError (run on
    every call of the op: kept to a few dict / tuple operations per tensor)."""
    params = list(inspect.signature(REFERENCES[decl.name]).parameters)
    rules = []
    for name, rule in decl.rules.items():
        dtypes, optional, dims = parse_rule(rule)
        lead = dims[:1] == ("...",)
        tail = tuple(int(d) if d.isdigit() else d for d in dims[lead:])
        if tail and type(tail[-1]) is str and tail[-1].endswith("?"):  # a last size that may be absent
            tail, short = (*tail[:-1], tail[-1][:-1]), tail[:-1]
        else:
            short = None
        rules.append((params.index(name), name, dtypes, optional, lead, tail, short, " ".join(dims)))

    def fail(message: str):
        raise KernelArgumentError(f"{decl.qualname}: {message}")

    def check(*args) -> None:
        env = dict(zip(params, args))
        for i, name, dtypes, optional, lead, tail, short, dims in rules:
            t = args[i] if i < len(args) else None  # (a trailing default argument may be left out: None)
            if t is None:
                if not optional:
                    fail(f"{name} is required")
                continue
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                fail(f"{name} must be {'/'.join(map(str, dtypes))}, got {got}")
            shape = t.shape
            if short is not None and not lead and len(shape) == len(short):
                tail = short  # the optional last size absent (this tensor only)
            n = len(shape) - len(tail)
            if n < 0 or (n and not lead):
                fail(f"{name} must be [{dims}], got {list(shape)}")
            if lead:
                want = env.setdefault("...", shape[:n])
                if want != shape[:n]:
                    fail(f"{name} [{dims}] has leading sizes {list(shape[:n])}, elsewhere {list(want)}")
            for sym, size in zip(tail, shape[n:]):
                want = sym if type(sym) is int else env.setdefault(sym, size)
                if want != size:
                    fail(f"{name} [{dims}] has {sym} = {size}, elsewhere {want}")
            if t.numel() > INT_MAX:
                fail(f"{name} has {t.numel()} elements (at most 2**31 - 1)")
        problem = decl.where(env)
        if problem:
            fail(problem)

    return check


CHECKS = {decl.name: make_checker(decl) for decl in DECLARATIONS}


def _contiguous(out):
    return out.contiguous() if isinstance(out, torch.Tensor) else tuple(t.contiguous() for t in out)


def _cpu_impl(decl: OpDeclaration):
    check, kernel, ref = CHECKS[decl.name], KERNELS[decl.name], REFERENCES[decl.name]

    def impl(*args):
        check(*args)  # before any C call: the declared dtypes / shapes, then the wrapper's layout / size checks
        if torch.is_grad_enabled():  # (the wrappers decline under autograd; the op has no backward anyway)
            with torch.no_grad():
                out = kernel(*args)
                return _contiguous(ref(*args) if out is None else out)
        out = kernel(*args)
        return _contiguous(ref(*args) if out is None else out)

    return impl


def _fake_impl(decl: OpDeclaration):
    ref = REFERENCES[decl.name]
    return lambda *args: _contiguous(ref(*args))


_LIBRARY = torch.library.Library("hybridcache", "FRAGMENT")  # nn/core/linear.py holds the namespace's DEF
for _decl in DECLARATIONS:
    _LIBRARY.define(_decl.name + _decl.schema)
    _LIBRARY.impl(_decl.name, _cpu_impl(_decl), "CPU")
    torch.library.register_fake(_decl.qualname, _fake_impl(_decl), lib=_LIBRARY)


def op(name: str):
    """The registered op `hybridcache::<name>` (torch.ops.hybridcache.<name>)."""
    return getattr(torch.ops.hybridcache, name).default

"""Pure-torch references of the registered ops (registry.py), in float32, one per op with the op's flat signature.

They define what each C kernel computes (tests compare kernel, registered op and compiled op against them), serve
as the op's CPU path where the kernel does not take the arguments or is not built, and, run on fake tensors, as
its fake (meta) implementation for torch.compile.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from hybridcache.ops import q8_0
from hybridcache.ops.selective_scan import _selective_scan_torch

_ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}
_ACT["gelu_new"] = _ACT["gelu_pytorch_tanh"]


def decode_linear(x, weight, bias, scale):
    """x [..., K] @ weight [N, K]^T (* scale [N]) (+ bias [N]) -> [..., N]; a 2-D scale: q8_0 (decode_linear_q8_0)."""
    if scale is not None and scale.dim() == 2:
        return q8_0.linear(x, weight, scale, bias)
    out = F.linear(x, weight.float())
    out = out if scale is None else out * scale
    return out if bias is None else out + bias


def decode_linear_q8_0(x, weight, bias, scale):
    """x [..., K] quantized per block of 32 @ the q8_0 weight (int8 [N, K], float16 scale [N, K / 32])^T (+ bias)."""
    return q8_0.linear(x, weight, scale, bias)


def rms_norm(x, scale, eps):
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D]."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def residual_norm(h, x, post_scale, post_eps, next_scale, next_eps):
    """(h + rms_norm(x) * post (x when post_scale is None), its rms_norm by next (empty when next_scale is None))."""
    s = h + (x if post_scale is None else rms_norm(x, post_scale, post_eps))
    return s, (s.new_empty(0) if next_scale is None else rms_norm(s, next_scale, next_eps))


def act_mul(gate_up, act):
    """act(gate) * up of gate_up [..., 2I] (gate first) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return _ACT[act](gate) * up


def argmax_rows(x):
    """x [B, V].argmax(-1) -> int64 [B]."""
    return x.argmax(-1)


def visible(qpos, kpos, pattern, param):
    """[B, S]: key slot s visible to the query at qpos [B, 1] (kpos [B, S]; a negative position is an empty slot)."""
    ok = (qpos >= 0) & (kpos >= 0) & (kpos <= qpos)
    if pattern == "sliding":
        ok = ok & (kpos > qpos - param)
    elif pattern == "chunked":
        ok = ok & (torch.div(kpos, param, rounding_mode="floor") == torch.div(qpos, param, rounding_mode="floor"))
    return ok


def decode_attention(q, k, v, mask, q_pos, k_pos, pattern, param, scale, softcap, sinks=None):
    """One query per row: q [B, Hq, 1, D], k / v [B, Hkv, S, D], visibility by mask [B, 1, S] or by positions and
    pattern -> [B, Hq, 1, D]; a row that sees nothing gets zeros. `sinks` [Hq] (or None): a learned logit per query
    head, one more softmax column that weights no value (GPT-OSS)."""
    b, hq, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    seen = mask.reshape(b, s) if mask is not None else visible(q_pos.reshape(b, 1), k_pos, pattern, param)
    kk = k.repeat_interleave(hq // hkv, dim=1) if hkv else k  # [B, Hq, S, D]
    vv = v.repeat_interleave(hq // hkv, dim=1) if hkv else v
    logits = (q @ kk.transpose(-1, -2)) * scale  # [B, Hq, 1, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
    if sinks is not None:  # the sink column: in the denominator, dropped before the weighted sum
        sink = sinks.reshape(1, hq, 1, 1).expand(b, hq, 1, 1)
        weights = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :s]
        weights = weights.masked_fill(~seen.any(-1)[:, None, None, None], 0.0)  # all hidden: zeros
    else:
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all hidden: zeros
    return weights @ vv


def rope(x, cos, sin, interleaved):
    """x [B, H, T, D]: the first R features rotated by cos / sin [B, 1, T, R], the rest copied."""
    r = cos.shape[-1]
    head = x[..., :r]
    if interleaved:
        rot = torch.stack((-head[..., 1::2], head[..., ::2]), dim=-1).reshape(head.shape)
    else:
        rot = torch.cat((-head[..., r // 2 :], head[..., : r // 2]), dim=-1)
    return torch.cat((head * cos + rot * sin, x[..., r:]), dim=-1)


def norm_rope(x, scale, eps, cos, sin, interleaved):
    """rms_norm of x [B, H, T, D] by scale [D] (None: none), then rope by cos / sin (None: none)."""
    y = x if scale is None else rms_norm(x, scale, eps)
    return y if cos is None else rope(y, cos, sin, interleaved)


def selective_scan(u, delta, z, b, c, a, d, bias, softplus, state):
    """Mamba1 selective scan on [B, T, Dm] / [B, T, N] layouts -> (y [B, T, Dm], final state [B, Dm, N])."""
    t = lambda x: None if x is None else x.transpose(1, 2)  # noqa: E731 [B, T, X] -> [B, X, T]
    y, last = _selective_scan_torch(t(u), t(delta), a, t(b), t(c), d, t(z), bias, softplus, state)
    return y.transpose(1, 2), last


def gated_mlp(x, w_gu, b_gu, s_gu, w_dn, b_dn, s_dn, act):
    """down(act(gate(x)) * up(x)): w_gu [2I, D] (gate rows first), w_dn [D, I]."""
    return decode_linear(act_mul(decode_linear(x, w_gu, b_gu, s_gu), act), w_dn, b_dn, s_dn)


def decoder_tail(
    h,
    a,
    w_o,
    b_o,
    s_o,
    post_attn,
    post_attn_eps,
    pre_mlp,
    pre_mlp_eps,
    w_gu,
    b_gu,
    s_gu,
    w_dn,
    b_dn,
    s_dn,
    act,
    post_mlp,
    post_mlp_eps,
):
    """A decoder layer after its attention: h1 = h + o (the output projection of a, rms-normed by post_attn unless
    None), the gated MLP of h1 (rms-normed by pre_mlp unless None), added to h1 (rms-normed by post_mlp unless None)."""
    h1, x = residual_norm(h, decode_linear(a, w_o, b_o, s_o), post_attn, post_attn_eps, pre_mlp, pre_mlp_eps)
    m = gated_mlp(h1 if pre_mlp is None else x, w_gu, b_gu, s_gu, w_dn, b_dn, s_dn, act)
    return residual_norm(h1, m, post_mlp, post_mlp_eps, None, 0.0)[0]


def qkv_norm_rope(
    x,
    w,
    bias,
    wscale,
    heads,
    kv_heads,
    head_dim,
    q_scale,
    q_eps,
    k_scale,
    k_eps,
    cos,
    sin,
    il,
    in_scale=None,
    in_eps=0.0,
):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] from x [B, T, Dm] (through rms_norm by in_scale first, unless None)
    by the fused projection w [(Hq + 2 Hkv) D, Dm], q / k through norm_rope."""
    b, t, _ = x.shape
    x = x if in_scale is None else rms_norm(x, in_scale, in_eps)
    q, k, v = decode_linear(x, w, bias, wscale).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    split = lambda y, h: y.reshape(b, t, h, head_dim).transpose(1, 2)  # noqa: E731
    q = norm_rope(split(q, heads), q_scale, q_eps, cos, sin, il)
    k = norm_rope(split(k, kv_heads), k_scale, k_eps, cos, sin, il)
    return q, k, split(v, kv_heads)


def attention_step(
    x,
    w,
    bias,
    wscale,
    heads,
    kv_heads,
    head_dim,
    q_scale,
    q_eps,
    k_scale,
    k_eps,
    cos,
    sin,
    il,
    in_scale,
    in_eps,
    keys,
    values,
    slot,
    q_pos,
    k_pos,
    pattern,
    param,
    scale,
    softcap,
    sinks=None,
):
    """A decode step's attention: q, k, v of x [B, 1, Dm] by qkv_norm_rope, k and v written into slot `slot` of the
    cache's keys / values [B, Hkv, S, D] (in place), then decode_attention of q over all S slots by positions
    (k_pos [B, S] already holding the token's) -> [B, 1, Hq * D]."""
    q, k, v = qkv_norm_rope(
        x, w, bias, wscale, heads, kv_heads, head_dim, q_scale, q_eps, k_scale, k_eps, cos, sin, il, in_scale, in_eps
    )
    keys[:, :, slot] = k[:, :, 0]
    values[:, :, slot] = v[:, :, 0]
    out = decode_attention(q, keys, values, None, q_pos, k_pos, pattern, param, scale, softcap, sinks)
    return out.reshape(x.shape[0], 1, heads * head_dim)


def decoder_layer(*args):
    """A decode step's whole decoder layer: decoder_tail of x (the residual) and attention_step's output -> [B, 1,
    Dm], the token's keys and values written into `slot` of keys / values. Arguments: attention_step's, then
    decoder_tail's after h and a (its signature, below, is built from theirs)."""
    return decoder_tail(args[0], attention_step(*args[:_STEP_ARGS]), *args[_STEP_ARGS:])


_STEP_ARGS = len(inspect.signature(attention_step).parameters)
decoder_layer.__signature__ = inspect.Signature(  # (the registry reads argument names from it)
    [p.replace(default=inspect.Parameter.empty) for p in inspect.signature(attention_step).parameters.values()]
    + list(inspect.signature(decoder_tail).parameters.values())[2:]
)

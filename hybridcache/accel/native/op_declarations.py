"""The one declaration of every native op: its torch.library schema, the dtype / shape rules of its arguments, the
C functions it calls with their ctypes signatures, and which kernel variant serves which dtype or pattern (tables,
not if-chains). op_registry.py turns each into a `hybridcache::<name>` op (a CPU kernel, a fake implementation from
op_reference.py, the rules checked before any C call); kernels.py takes the ctypes signatures from here.

A rule is "dtypes[dims]": dtypes one or more of f32 / bf16 / i8 / i64 / bool joined by "|", a trailing "?" for an
optional tensor (None), dims space-separated sizes: a symbol (bound on first use, equal wherever it recurs), an
integer, or "..." (any leading sizes, equal wherever it recurs); a last size with a trailing "?" may be absent (a
weight's scale: [N] per row, or [N G] per block of 32 for q8_0). `where` states what the rules cannot (e.g. even
widths); it gets the bound sizes and the non-tensor arguments and returns what is wrong, or None.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float

# Kernel variants, as data. Weight dtype -> the linear kernel that streams it (and the fused kernels' type code).
WEIGHT_KERNELS = {torch.float32: "hc_linear_f32", torch.bfloat16: "hc_linear_bf16", torch.int8: "hc_linear_i8"}
GEMM_KERNELS = {torch.float32: "hc_gemm_f32", torch.bfloat16: "hc_gemm_bf16", torch.int8: "hc_gemm_i8"}  # many rows
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
Q8_0_TYPE = 3  # int8 weights with a float16 scale [N, K / 32] per block of 32 (hybridcache/ops/q8_0.py)
Q8_0_BLOCK = 32
ACT_MUL = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}  # activations hc_act_mul computes -> its code
PATTERNS = {"full": 0, "sliding": 1, "chunked": 2}  # what hc_decode_attention evaluates itself from positions

# C functions every library has besides the ops': what it was built for.
INFO_SIGNATURES: dict[str, tuple[object, list]] = {
    "hc_isa": (ctypes.c_char_p, []),
    "hc_openmp": (_I, []),
    "hc_threads": (_I, []),
}

DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i8": torch.int8,
    "i64": torch.int64,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class OpDeclaration:
    name: str
    schema: str  # torch.library schema without the name: "(Tensor x, ...) -> Tensor"
    rules: dict[str, str]  # tensor argument -> "dtypes[dims]" (see the module docstring)
    c: dict[str, tuple[object, list]]  # C function -> (return type, argument types)
    where: Callable[[dict], str | None] = field(default=lambda env: None)

    @property
    def qualname(self) -> str:
        return f"hybridcache::{self.name}"


def _linear_c() -> dict:
    decode = {name: (None, [_P] * 5 + [_I] * 3) for name in WEIGHT_KERNELS.values()}
    return {**decode, **{name: (_I, [_P] * 5 + [_I] * 3) for name in GEMM_KERNELS.values()}}


def _choice(value, table: dict, what: str) -> str | None:
    return None if value in table else f"unknown {what} {value!r}; known: {', '.join(table)}"


def _scales_where(env: dict, *pairs: tuple[str, str, str]) -> str | None:
    """Each (weight, its scale, the symbol of its columns): no scale, a float32 one of one size per row, or a q8_0
    float16 one [rows, columns / 32] of an int8 weight."""
    for w, s, cols in pairs:
        scale = env.get(s)
        if scale is None or scale.dtype == torch.float32 and scale.dim() == 1:
            continue
        if scale.dtype != torch.float16 or scale.dim() != 2 or env[w].dtype != torch.int8:
            return f"{s}: a float32 [rows] scale, or float16 [rows, columns / 32] for q8_0 int8 weights"
        if env[cols] != Q8_0_BLOCK * scale.shape[1]:
            return f"{s}: q8_0 needs {cols} = {Q8_0_BLOCK} x {scale.shape[1]} blocks, got {env[cols]}"
    return None


_MLP_SCALES = (("w_gu", "s_gu", "Dm"), ("w_dn", "s_dn", "I"))
_STEP_SCALES = (("w", "wscale", "Dm"),)


def _attention_where(env: dict) -> str | None:
    if env["Hkv"] == 0 or env["Hq"] % env["Hkv"]:
        return f"{env['Hq']} query heads are not a multiple of {env['Hkv']} key / value heads"
    if (env["mask"] is None) == (env["q_pos"] is None or env["k_pos"] is None):
        return "give either a mask or both positions (q_pos, k_pos)"
    if env["mask"] is None:
        bad = _choice(env["pattern"], PATTERNS, "attention pattern")
        if bad or env["pattern"] == "full":
            return bad
        if env["param"] < 1:
            return f"a {env['pattern']} pattern needs a window / chunk size >= 1, got {env['param']}"
    if env["softcap"] is not None and not env["softcap"] > 0:
        return f"softcap must be > 0 or None, got {env['softcap']}"
    return None


def _rotary_where(env: dict) -> str | None:
    if (env.get("cos") is None) != (env.get("sin") is None):
        return "cos and sin: both or neither"
    r, d = env.get("R", 0), env["D"]
    return None if r % 2 == 0 and r <= d else f"the rotary width {r} must be even and at most the head dim {d}"


def _qkv_where(env: dict) -> str | None:
    bad = _scales_where(env, *_STEP_SCALES)
    if bad:
        return bad
    heads, kv, hd = env["heads"], env["kv_heads"], env["head_dim"]
    if min(heads, kv, hd) < 1:
        return f"heads, kv_heads, head_dim must be >= 1, got {heads}, {kv}, {hd}"
    if env["W"] != (heads + 2 * kv) * hd:
        return f"the fused projection has {env['W']} rows, not (heads + 2 kv_heads) * head_dim"
    if env.get("Dq", hd) != hd or env.get("Dk", hd) != hd:
        return "q / k norm scales must have head_dim features"
    return _rotary_where({**env, "D": hd})


_W = "f32|bf16|i8"
# a gated MLP's fused gate / up matrix (gate rows first) and down matrix, each with an optional bias and int8 scale
_MLP_RULES = {
    "w_gu": f"{_W}[G Dm]",
    "b_gu": "f32?[G]",
    "s_gu": "f32|f16?[G Ggu?]",
    "w_dn": f"{_W}[Dm I]",
    "b_dn": "f32?[Dm]",
    "s_dn": "f32|f16?[Dm Gdn?]",
}


def _mlp_where(env: dict) -> str | None:
    return (
        _choice(env["act"], ACT_MUL, "activation")
        or (env["G"] != 2 * env["I"] and "G != 2 I" or None)
        or _scales_where(env, *_MLP_SCALES)
    )


def _tail_where(env: dict) -> str | None:
    return _mlp_where(env) or _scales_where(env, ("w_o", "s_o", "A"))


# A decode step's one-call attention (attention_step), and the decoder tail after it (decoder_layer): the arguments
# as declared once for both ops.
_STEP_SCHEMA = (
    "Tensor x, Tensor w, Tensor? bias, Tensor? wscale, int heads, int kv_heads, int head_dim, Tensor? q_scale, "
    "float q_eps, Tensor? k_scale, float k_eps, Tensor? cos, Tensor? sin, bool interleaved, Tensor? in_scale, "
    "float in_eps, Tensor(a!) keys, Tensor(b!) values, int slot, Tensor q_pos, Tensor k_pos, str pattern, "
    "int param, float scale, float? softcap, Tensor? sinks"
)
_STEP_RULES = {
    "x": "f32[B 1 Dm]",
    "w": f"{_W}[W Dm]",
    "bias": "f32?[W]",
    "wscale": "f32|f16?[W Gw?]",
    "q_scale": "f32?[Dq]",
    "k_scale": "f32?[Dk]",
    "cos": "f32?[B 1 1 R]",
    "sin": "f32?[B 1 1 R]",
    "in_scale": "f32?[Dm]",
    "keys": "f32[B Hkv S D]",
    "values": "f32[B Hkv S D]",
    "q_pos": "i64[B 1]",
    "k_pos": "i64[B S]",
    "sinks": "f32?[Hq]",
}
_STEP_C = (
    [_P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _P, _P, _F, _P, _F, _P, _P, _I, _I, _P, _P, _P, _F, _P]
    + [_P, _P, _L, _I]
    + [_L] * 6
    + [_P, _P, _I, _L, _F, _F, _P, _P]
)
_TAIL_SCHEMA = (
    "Tensor w_o, Tensor? b_o, Tensor? s_o, Tensor? post_attn, float post_attn_eps, Tensor? pre_mlp, "
    "float pre_mlp_eps, Tensor w_gu, Tensor? b_gu, Tensor? s_gu, Tensor w_dn, Tensor? b_dn, Tensor? s_dn, str act, "
    "Tensor? post_mlp, float post_mlp_eps"
)
_TAIL_RULES = {
    "w_o": f"{_W}[Dm A]",
    "b_o": "f32?[Dm]",
    "s_o": "f32|f16?[Dm Go?]",
    "post_attn": "f32?[Dm]",
    "pre_mlp": "f32?[Dm]",
    **_MLP_RULES,
    "post_mlp": "f32?[Dm]",
}
_TAIL_C = [_P, _I, _P, _P, _P, _F, _P, _F, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _F, _P, _P]


# hc_decoder_layer's C arguments; also the record of hc_decoder_stack, which runs many such calls (eager decode,
# accel/native/decoder_stack.py): the library states its record's field types, which must be these (checked at load).
LAYER_RECORD = _STEP_C + _TAIL_C
STACK_SIGNATURES: dict[str, tuple[object, list]] = {
    "hc_layer_record_codes": (ctypes.c_char_p, []),
    "hc_layer_record_names": (ctypes.c_char_p, []),
    "hc_layer_record_size": (_I, []),
    "hc_decoder_stack": (_I, [_P, _I, _P]),
    # accel/runs/decode_run.py: greedy decode steps of one row over a stack's records, its embedding and head
    "hc_decode_steps": (
        _I,
        [_P, _I, _I, _P, _P, _P, _P, _I, _P, _I, _P, _L, _F, _P, _F, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _L]
        + [_P, _P],
    ),
}


def _step_where(env: dict) -> str | None:
    heads, kv, hd = env["heads"], env["kv_heads"], env["head_dim"]
    if env["Hkv"] != kv or env["D"] != hd or env.get("Hq", heads) != heads:
        return (
            f"the cache's keys [B, {env['Hkv']}, S, {env['D']}] (sinks [{env.get('Hq', heads)}]) do not match "
            f"{heads} heads / {kv} kv heads of {hd}"
        )
    if not 0 <= env["slot"] < env["S"]:
        return f"slot {env['slot']} is outside the cache's {env['S']} slots"
    return _qkv_where(env) or _attention_where({**env, "Hq": heads, "mask": None})


def _layer_where(env: dict) -> str | None:
    if env["A"] != env["heads"] * env["head_dim"]:
        return f"o_proj reads {env['A']} features, the attention writes {env['heads']} x {env['head_dim']}"
    return _step_where(env) or _tail_where(env)


DECLARATIONS: tuple[OpDeclaration, ...] = (
    OpDeclaration(
        "decode_linear",
        "(Tensor x, Tensor weight, Tensor? bias, Tensor? scale) -> Tensor",
        {"x": "f32[... K]", "weight": f"{_W}[N K]", "bias": "f32?[N]", "scale": "f32?[N]"},
        _linear_c(),
    ),
    OpDeclaration(
        "decode_linear_q8_0",
        "(Tensor x, Tensor weight, Tensor? bias, Tensor scale) -> Tensor",
        {"x": "f32[... K]", "weight": "i8[N K]", "bias": "f32?[N]", "scale": "f16[N G]"},
        {"hc_linear_q8_0": (None, [_P] * 5 + [_I] * 3)},
        lambda env: (
            None
            if env["K"] == Q8_0_BLOCK * env["G"]
            else f"q8_0 needs K = {Q8_0_BLOCK} x the scale's G blocks, got K = {env['K']}, G = {env['G']}"
        ),
    ),
    OpDeclaration(
        "rms_norm",
        "(Tensor x, Tensor scale, float eps) -> Tensor",
        {"x": "f32[... D]", "scale": "f32[D]"},
        {"hc_rms_norm": (None, [_P] * 3 + [_I] * 2 + [_F])},
    ),
    OpDeclaration(
        "residual_norm",
        "(Tensor h, Tensor x, Tensor? post_scale, float post_eps, Tensor? next_scale, float next_eps) "
        "-> (Tensor, Tensor)",
        {"h": "f32[... D]", "x": "f32[... D]", "post_scale": "f32?[D]", "next_scale": "f32?[D]"},
        {"hc_residual_norm": (None, [_P] * 3 + [_F, _P, _F] + [_P] * 2 + [_I] * 2)},
    ),
    OpDeclaration(
        "act_mul",
        "(Tensor gate_up, str act) -> Tensor",
        {"gate_up": "f32[... G]"},
        {"hc_act_mul": (None, [_P] * 2 + [_I] * 3)},
        lambda env: _choice(env["act"], ACT_MUL, "activation") or (env["G"] % 2 and f"odd width {env['G']}" or None),
    ),
    OpDeclaration(
        "argmax_rows",
        "(Tensor x) -> Tensor",
        {"x": "f32[B V]"},
        {"hc_argmax_rows": (None, [_P] * 2 + [_I, _L])},
        lambda env: None if env["V"] > 0 else "argmax of an empty row",
    ),
    OpDeclaration(
        "decode_attention",
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? q_pos, Tensor? k_pos, str pattern, int param, "
        "float scale, float? softcap, Tensor? sinks=None) -> Tensor",
        {
            "q": "f32[B Hq 1 D]",
            "k": "f32[B Hkv S D]",
            "v": "f32[B Hkv S D]",
            "mask": "bool?[B 1 S]",
            "q_pos": "i64?[B 1]",
            "k_pos": "i64?[B S]",
            "sinks": "f32?[Hq]",
        },
        {"hc_decode_attention": (_I, [_P] * 6 + [_I, _L, _P] + [_I] * 5 + [_L] * 6 + [_F] * 2 + [_P])},
        _attention_where,
    ),
    OpDeclaration(
        "rope",
        "(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
        {"x": "f32[B H T D]", "cos": "f32[B 1 T R]", "sin": "f32[B 1 T R]"},
        {"hc_rope": (None, [_P] + [_L] * 3 + [_P] * 3 + [_I] * 6)},
        _rotary_where,
    ),
    OpDeclaration(
        "norm_rope",
        "(Tensor x, Tensor? scale, float eps, Tensor? cos, Tensor? sin, bool interleaved) -> Tensor",
        {"x": "f32[B H T D]", "scale": "f32?[D]", "cos": "f32?[B 1 T R]", "sin": "f32?[B 1 T R]"},
        {"hc_norm_rope": (None, [_P] + [_L] * 3 + [_P, _F] + [_P] * 3 + [_I] * 6)},
        _rotary_where,
    ),
    OpDeclaration(
        "selective_scan",
        "(Tensor u, Tensor delta, Tensor? z, Tensor b, Tensor c, Tensor a, Tensor? d, Tensor? bias, bool softplus, "
        "Tensor? state) -> (Tensor, Tensor)",
        {
            "u": "f32[B T Dm]",
            "delta": "f32[B T Dm]",
            "z": "f32?[B T Dm]",
            "b": "f32[B T N]",
            "c": "f32[B T N]",
            "a": "f32[Dm N]",
            "d": "f32?[Dm]",
            "bias": "f32?[Dm]",
            "state": "f32?[B Dm N]",
        },
        {"hc_selective_scan": (None, [_P, _L, _L] * 5 + [_P] * 3 + [_I] + [_P] * 3 + [_I] * 4)},
    ),
    OpDeclaration(
        "gated_mlp",
        "(Tensor x, Tensor w_gu, Tensor? b_gu, Tensor? s_gu, Tensor w_dn, Tensor? b_dn, Tensor? s_dn, str act) "
        "-> Tensor",
        {"x": "f32[... Dm]", **_MLP_RULES},
        {"hc_gated_mlp": (None, [_P] + [_I] * 3 + [_P, _I] + [_P] * 3 + [_I] + [_P] * 2 + [_I] + [_P] * 2)},
        _mlp_where,
    ),
    OpDeclaration(
        "qkv_norm_rope",
        "(Tensor x, Tensor w, Tensor? bias, Tensor? wscale, int heads, int kv_heads, int head_dim, Tensor? q_scale, "
        "float q_eps, Tensor? k_scale, float k_eps, Tensor? cos, Tensor? sin, bool interleaved, "
        "Tensor? in_scale=None, float in_eps=0.0) -> (Tensor, Tensor, Tensor)",
        {
            "x": "f32[B T Dm]",
            "w": f"{_W}[W Dm]",
            "bias": "f32?[W]",
            "wscale": "f32|f16?[W Gw?]",
            "q_scale": "f32?[Dq]",
            "k_scale": "f32?[Dk]",
            "cos": "f32?[B 1 T R]",
            "sin": "f32?[B 1 T R]",
            "in_scale": "f32?[Dm]",
        },
        {
            "hc_qkv_norm_rope": (
                None,
                [_P]
                + [_I] * 3
                + [_P, _I]
                + [_P] * 2
                + [_I] * 3
                + [_P] * 2
                + [_F, _P, _F]
                + [_P] * 2
                + [_I] * 2
                + [_P] * 2
                + [_P, _F, _P],
            )
        },
        _qkv_where,
    ),
    OpDeclaration(
        "decoder_tail",
        f"(Tensor h, Tensor a, {_TAIL_SCHEMA}) -> Tensor",
        {"h": "f32[... Dm]", "a": "f32[... A]", **_TAIL_RULES},
        {"hc_decoder_tail": (None, [_P, _P, _I, _I, _I] + _TAIL_C)},
        _tail_where,
    ),
    OpDeclaration(
        "attention_step",
        f"({_STEP_SCHEMA}=None) -> Tensor",
        _STEP_RULES,
        {"hc_attention_step": (_I, _STEP_C)},
        _step_where,
    ),
    OpDeclaration(
        "decoder_layer",
        f"({_STEP_SCHEMA}, {_TAIL_SCHEMA}) -> Tensor",
        {**_STEP_RULES, **_TAIL_RULES},
        {"hc_decoder_layer": (_I, LAYER_RECORD)},
        _layer_where,
    ),
)


# A recurrent mixer's one-token step in one call (csrc/recurrent_step.c; accel/mixers/recurrent.py): eager only,
# called through native/steps/recurrent.py's checked wrappers (no torch op: under torch.compile the reference runs).
RECURRENT_SIGNATURES: dict[str, tuple[object, list]] = {
    "hc_short_conv_step": (None, [_P] + [_I] * 3 + [_P, _I] + [_P] * 7 + [_I] + [_P] * 4),
    "hc_mamba2_step": (
        None,
        [_P] + [_I] * 7 + [_P, _I] + [_P] * 9 + [_F, _F] + [_P] * 2 + [_I, _P, _F, _P, _I] + [_P] * 4,
    ),
    "hc_gated_delta_step": (
        None,
        [_P] + [_I] * 7 + [_P, _I, _P, _P, _I, _P] + [_P] * 5 + [_F] + [_P] * 3 + [_F, _P, _I] + [_P] * 3,
    ),
    "hc_mamba_step": (
        None,
        [_P] + [_I] * 6 + [_P, _I] + [_P] * 7 + [_I, _P] + [_P, _F] * 3 + [_P, _I] + [_P] * 7 + [_I] + [_P] * 4,
    ),
    "hc_delta_step": (
        None,
        [_P, *[_I] * 8, *[_P] * 5, _I, *[_P] * 3, *[_I] * 4, _F, _P, _P, _F, _P, _P, _I, _P, _F, _P, _I, _P, _P, _P],
    ),
    "hc_rglru_step": (None, [_P] + [_I] * 5 + [_P, _I, _P, _P] * 2 + [_P] * 12 + [_P, _I] + [_P] * 4),
    "hc_oss_experts_step": (None, [_P, _I, _I, _I] + [_P] * 6 + [_F, _F, _P, _P]),
    "hc_mamba_groups_step": (None, [_P] + [_I] * 7 + [_P, _I] + [_P] * 13 + [_P, _I] + [_P] * 4),
}

# A decode step's pre-norm layers as one program of records (csrc/layer_program.c; accel/native/layer_program.py):
# each record is one call's arguments, its layout stated by the library and checked against the call's signature.
PRE_NORM_TAIL = [_P, _P, _I, _I, _P, _F, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P]
PROGRAM_SIGNATURES: dict[str, tuple[object, list]] = {
    "hc_op_record_codes": (ctypes.c_char_p, [_I]),
    "hc_op_record_names": (ctypes.c_char_p, [_I]),
    "hc_op_record_size": (_I, [_I]),
    "hc_op_count": (_I, []),
    "hc_layer_program": (_I, [_P, _P, _I, _P]),
    # accel/runs/program_run.py: greedy decode steps of one row over a layer program, its embedding and head
    "hc_program_steps": (
        _I,
        [_P, _P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _I, _P, _L, _F, _P, _F, _P]
        + [_I, _P, _P, _I, _P, _P, _I, _P, _P, _I, _P, _I, _L, _P, _P],
    ),
    "hc_pre_norm_tail": (None, PRE_NORM_TAIL),
    "hc_pre_norm_mlp": (None, [_P, _I, _I, _P, _F, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P]),
    "hc_sandwich_tail": (None, [_P, _P, _I, _I, _P, _F, *PRE_NORM_TAIL[4:16], _P, _F, _P, _P]),
    "hc_attention_layer": (_I, LAYER_RECORD),  # hc_decoder_layer's record, no MLP (its MLP fields unread)
    # a gated attention (q_proj's per-head [query | gate]; sigmoid(gate) times the attention output): the step's and
    # the whole layer's records of the same layouts
    "hc_gated_attention_step": (_I, _STEP_C),
    "hc_gated_decoder_layer": (_I, LAYER_RECORD),
}

# The library's whole interface: the loader refuses a library that lacks any of these names (torch path).
SIGNATURES: dict[str, tuple[object, list]] = {
    **INFO_SIGNATURES,
    **STACK_SIGNATURES,
    **RECURRENT_SIGNATURES,
    **PROGRAM_SIGNATURES,
}
for _decl in DECLARATIONS:
    SIGNATURES.update(_decl.c)


def parse_rule(rule: str) -> tuple[tuple[torch.dtype, ...], bool, tuple[str, ...]]:
    """'f32|bf16?[N K]' -> ((float32, bfloat16), optional, ('N', 'K')) (a last size 'G?' stays 'G?')."""
    head, dims = rule.rstrip("]").split("[")
    optional = head.endswith("?")
    return tuple(DTYPES[d] for d in head.rstrip("?").split("|")), optional, tuple(dims.split())

/* A decoder layer's branches in one call each, and a decode step's attention or whole layer in one call: the
   gated MLP (hc_act_mul, hc_gated_mlp), the q / k / v projection with its norms and rotary (hc_qkv_norm_rope), the
   step's attention (hc_attention_step), everything after it (hc_decoder_tail), both (hc_decoder_layer). Each calls
   the op-family kernels in the same order as the separate calls: the same bits, no interpreter in between. */
#include "hc_internal.h"
#include "layer_record.h"

/* out[r, i] = act(gu[r, i]) * gu[r, I + i]: a gated MLP's activation of its fused gate / up projection [rows, 2I].
   act 0: SiLU x / (1 + exp(-x)); 1: GELU's tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
   as the equal x / (1 + exp(-2u)) (no cancellation in 1 + tanh(u) for negative u). */
void hc_act_mul(const float *gu, float *out, int rows, int I, int act) {
  int wide = (size_t)rows * I >= PARALLEL_BYTES / 4;
  const float c = 0.7978845608028654f, c3 = 0.044715f;
  _Pragma("omp parallel for schedule(static) if(wide)") for (int r = 0; r < rows; r++) {
    const float *g = gu + (size_t)r * 2 * I, *u = g + I;
    float *o = out + (size_t)r * I;
    int i = 0;
#if VW > 1
    vf one = vset1(1.0f);
    for (; i + VW <= I; i += VW) {
      vf x = vload_f32(g + i);
      vf z = act == 0 ? x : vmul(vset1(2.0f * c), vfma(vmul(vset1(c3), x), vmul(x, x), x));
      vstore(o + i, vmul(x / (one + vexp(vset1(0.0f) - z)), vload_f32(u + i)));
    }
#endif
    for (; i < I; i++) {
      float x = g[i], z = act == 0 ? x : 2.0f * c * (x + c3 * x * x * x);
      o[i] = x / (1.0f + expf(-z)) * u[i];
    }
  }
}

/* weight type codes: 0 float32, 1 bfloat16, 2 int8 (+ per-row scale), 3 q8_0 (int8 + a float16 scale per block of
   32 along K, passed as `scale`) */
static void linear_any(int wtype, const float *x, const void *w, float *y, const float *scale, const float *bias,
                       int M, int N, int K) {
  if (wtype == 1) hc_linear_bf16(x, (const uint16_t *)w, y, scale, bias, M, N, K);
  else if (wtype == 2) hc_linear_i8(x, (const int8_t *)w, y, scale, bias, M, N, K);
  else if (wtype == 3) hc_linear_q8_0(x, (const int8_t *)w, y, (const uint16_t *)scale, bias, M, N, K);
  else hc_linear_f32(x, (const float *)w, y, scale, bias, M, N, K);
}

/* A gated MLP of M rows: y [M, D] = down(act(gate(x)) * up(x)) with the fused gate / up matrix [2I, D] (gate rows
   first) and down [D, I]; scratch: [M, 3I] floats. The same kernels, in the same order, as the separate calls. */
void hc_gated_mlp(const float *x, int M, int D, int I, const void *w_gu, int gu_type, const float *gu_scale,
                  const float *gu_bias, const void *w_down, int down_type, const float *down_scale,
                  const float *down_bias, int act, float *scratch, float *y) {
  float *gu = scratch, *a = scratch + (size_t)M * 2 * I;
  linear_any(gu_type, x, w_gu, gu, gu_scale, gu_bias, M, 2 * I, D);
  hc_act_mul(gu, a, M, I, act);
  linear_any(down_type, a, w_down, y, down_scale, down_bias, M, D, I);
}

/* The fused q / k / v projection of M = B * T rows, qkv [M, (Hq + 2 Hkv) D] (per row: q heads, k heads, v heads),
   then q and k each through hc_norm_rope (q_scale / k_scale NULL: no norm; rot 0: no rotary) into q_out
   [B, Hq, T, D] and k_out [B, Hkv, T, D]; v stays in qkv. in_scale (or NULL): the layer's input RMSNorm first,
   x -> xn [M, Dm] (as hc_rms_norm). */
void hc_qkv_norm_rope(const float *x, int B, int T, int Dm, const void *w, int wtype, const float *wscale,
                      const float *bias, int Hq, int Hkv, int D, float *qkv, const float *q_scale, float q_eps,
                      const float *k_scale, float k_eps, const float *cos_t, const float *sin_t, int rot,
                      int interleaved, float *q_out, float *k_out, const float *in_scale, float in_eps, float *xn) {
  long W = (long)(Hq + 2 * Hkv) * D;
  if (in_scale) {
    hc_rms_norm(x, in_scale, xn, B * T, Dm, in_eps);
    x = xn;
  }
  linear_any(wtype, x, w, qkv, wscale, bias, B * T, (int)W, Dm);
  hc_norm_rope(qkv, W * T, D, W, q_scale, q_eps, cos_t, sin_t, q_out, B, Hq, T, D, rot, interleaved);
  hc_norm_rope(qkv + (size_t)Hq * D, W * T, D, W, k_scale, k_eps, cos_t, sin_t, k_out, B, Hkv, T, D, rot, interleaved);
}

/* A decode step's attention in one call: one token per row, B rows. hc_qkv_norm_rope (T = 1; k into k_new
   [B, Hkv, D]), then the token's keys and values written into slot `slot` of every row of the cache's keys / values
   [B, Hkv, S, D] (strides in elements, contiguous last dim; the slot past the ones held, which the cache reserved),
   then hc_decode_attention of q over all S slots by positions (kpos [B, S] already holds the token's position):
   a [B, Hq, D], which is [B, Hq * D] as the output projection reads it. The same kernels in the same order as
   the separate calls. Returns 0; -3 (nothing done) for a slot outside [0, S) or Hkv < 1 or Hq not a multiple of it;
   else hc_decode_attention's code. */
int hc_attention_step(HC_STEP_FIELDS(HC_REC_FIELD, HC_REC_COMMA)) {
  if (slot < 0 || slot >= S || Hkv < 1 || Hq < 1 || Hq % Hkv || B < 1 || D < 1) return -3;
  hc_qkv_norm_rope(x, B, 1, Dm, w, wtype, wscale, bias, Hq, Hkv, D, qkv, q_scale, q_eps, k_scale, k_eps, cos_t, sin_t,
                   rot, interleaved, q_out, k_new, in_scale, in_eps, xn);
  size_t W = (size_t)(Hq + 2 * Hkv) * D;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < Hkv; h++) {
      float *kd = keys + b * ksb + h * ksh + slot * kss, *vd = values + b * vsb + h * vsh + slot * vss;
      const float *ks = k_new + ((size_t)b * Hkv + h) * D, *vs = qkv + b * W + (size_t)(Hq + Hkv + h) * D;
      for (int d = 0; d < D; d++) kd[d] = ks[d], vd[d] = vs[d];
    }
  return hc_decode_attention(q_out, keys, values, NULL, qpos, kpos, pattern, param, a, B, Hq, Hkv, S, D, ksb, ksh,
                             kss, vsb, vsh, vss, scale, softcap, sinks);
}

/* A decoder layer after its attention, M rows of D: o = a [M, A] @ w_o^T (the output projection), h1 = h + o
   (post_attn: h + rms_norm(o) * post_attn), x = rms_norm(h1) * pre_mlp (NULL: x = h1), m = the gated MLP of x
   (hc_gated_mlp), out = h1 + m (post_mlp: + rms_norm(m) * post_mlp). The same kernels, in the same order, as the
   separate calls. scratch: [M, 4 D + 3 I] floats. */
void hc_decoder_tail(const float *h, const float *a, int M, int D, int A, const void *w_o, int o_type,
                     const float *o_scale, const float *o_bias, const float *post_attn, float post_attn_eps,
                     const float *pre_mlp, float pre_mlp_eps, int I, const void *w_gu, int gu_type,
                     const float *gu_scale, const float *gu_bias, const void *w_dn, int dn_type,
                     const float *dn_scale, const float *dn_bias, int act, const float *post_mlp,
                     float post_mlp_eps, float *scratch, float *out) {
  size_t md = (size_t)M * D;
  float *o = scratch, *h1 = o + md, *x = h1 + md, *m = x + md, *mlp = m + md;
  linear_any(o_type, a, w_o, o, o_scale, o_bias, M, D, A);
  hc_residual_norm(h, o, post_attn, post_attn_eps, pre_mlp, pre_mlp_eps, h1, x, M, D);
  hc_gated_mlp(pre_mlp ? x : h1, M, D, I, w_gu, gu_type, gu_scale, gu_bias, w_dn, dn_type, dn_scale, dn_bias, act,
               mlp, m);
  hc_residual_norm(h1, m, post_mlp, post_mlp_eps, NULL, 0.0f, out, NULL, M, D);
}

/* A decode step's whole decoder layer in one call: hc_attention_step (its output into `a` [B, Hq * D]), then
   hc_decoder_tail of the layer input x (the residual) and a into y [B, Dm] (tail_scratch: [B, 4 Dm + 3 I] floats).
   The same kernels in the same order as the two calls. Returns hc_attention_step's code (the tail runs on 0). */
int hc_decoder_layer(HC_LAYER_RECORD(HC_REC_FIELD, HC_REC_COMMA)) {
  int err = hc_attention_step(HC_STEP_FIELDS(HC_REC_NAME, HC_REC_COMMA));
  if (err) return err;
  hc_decoder_tail(x, a, B, Dm, Hq * D, HC_TAIL_FIELDS(HC_REC_NAME, HC_REC_COMMA));
  return 0;
}

/* A decode step's attention layer with no MLP in one call (Nemotron-H's attention blocks: y = x + o_proj(attention(
   norm(x)))): hc_attention_step (its output into `a` [B, Hq * D]), o = a @ w_o^T into tail_scratch [B, Dm], then
   y = x + o (post_attn: x + rms_norm(o) * post_attn; hc_residual_norm). hc_decoder_layer's record, its MLP fields
   unread. The same kernels in the same order as the separate calls. Returns hc_attention_step's code. */
int hc_attention_layer(HC_LAYER_RECORD(HC_REC_FIELD, HC_REC_COMMA)) {
  (void)pre_mlp, (void)pre_mlp_eps, (void)I, (void)w_gu, (void)gu_type, (void)gu_scale, (void)gu_bias, (void)w_dn;
  (void)dn_type, (void)dn_scale, (void)dn_bias, (void)act, (void)post_mlp, (void)post_mlp_eps;
  int err = hc_attention_step(HC_STEP_FIELDS(HC_REC_NAME, HC_REC_COMMA));
  if (err) return err;
  linear_any(o_type, a, w_o, tail_scratch, o_scale, o_bias, B, Dm, Hq * D);
  hc_residual_norm(x, tail_scratch, post_attn, post_attn_eps, NULL, 0.0f, y, NULL, B, Dm);
  return 0;
}

/* A decode step's GATED attention in one call (Qwen3.5's, Qwen3-Next's: q_proj yields per head [query (D) | gate
   (D)], and the attention output is multiplied by sigmoid(gate) before o_proj). hc_attention_step's record, the
   fused projection [B, (2 Hq + 2 Hkv) D] per row: the q heads with their gates (head stride 2D), k heads, v heads.
   The input norm, the projection, q / k norms and rotary (hc_norm_rope over the q heads at stride 2D), the token's
   keys and values into slot `slot`, hc_decode_attention, then a [b, h D + d] *= 1 / (1 + exp(-gate)) (float32 noise
   from torch's sigmoid; the per-layer call and the records run this same code). Returns as hc_attention_step. */
int hc_gated_attention_step(HC_STEP_FIELDS(HC_REC_FIELD, HC_REC_COMMA)) {
  if (slot < 0 || slot >= S || Hkv < 1 || Hq < 1 || Hq % Hkv || B < 1 || D < 1) return -3;
  long W = (long)(2 * Hq + 2 * Hkv) * D;
  if (in_scale) {
    hc_rms_norm(x, in_scale, xn, B, Dm, in_eps);
    x = xn;
  }
  linear_any(wtype, x, w, qkv, wscale, bias, B, (int)W, Dm);
  hc_norm_rope(qkv, W, 2 * D, W, q_scale, q_eps, cos_t, sin_t, q_out, B, Hq, 1, D, rot, interleaved);
  hc_norm_rope(qkv + (size_t)2 * Hq * D, W, D, W, k_scale, k_eps, cos_t, sin_t, k_new, B, Hkv, 1, D, rot, interleaved);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < Hkv; h++) {
      float *kd = keys + b * ksb + h * ksh + slot * kss, *vd = values + b * vsb + h * vsh + slot * vss;
      const float *ks = k_new + ((size_t)b * Hkv + h) * D, *vs = qkv + b * W + (size_t)(2 * Hq + Hkv + h) * D;
      for (int d = 0; d < D; d++) kd[d] = ks[d], vd[d] = vs[d];
    }
  int err = hc_decode_attention(q_out, keys, values, NULL, qpos, kpos, pattern, param, a, B, Hq, Hkv, S, D, ksb, ksh,
                                kss, vsb, vsh, vss, scale, softcap, sinks);
  if (err) return err;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < Hq; h++) {
      float *o = a + ((size_t)b * Hq + h) * D;
      const float *g = qkv + b * W + (size_t)h * 2 * D + D;
      for (int d = 0; d < D; d++) o[d] = o[d] * (1.0f / (1.0f + expf(-g[d])));
    }
  return 0;
}

/* hc_decoder_layer with the gated attention step (hc_gated_attention_step, then hc_decoder_tail): its record. */
int hc_gated_decoder_layer(HC_LAYER_RECORD(HC_REC_FIELD, HC_REC_COMMA)) {
  int err = hc_gated_attention_step(HC_STEP_FIELDS(HC_REC_NAME, HC_REC_COMMA));
  if (err) return err;
  hc_decoder_tail(x, a, B, Dm, Hq * D, HC_TAIL_FIELDS(HC_REC_NAME, HC_REC_COMMA));
  return 0;
}

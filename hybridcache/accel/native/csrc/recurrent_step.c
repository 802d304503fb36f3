/* A recurrent mixer's one-token decode step in one call: LFM2's gated short convolution (hc_short_conv_step) and the
   Mamba2 SSD mixer (hc_mamba2_step): input projection, the depthwise causal conv step over the carried inputs, the
   state update, the gate and the output projection, with no interpreter between them. Part of cpu_decode.c (after
   fused_layer.c, whose linear_any they use). The states are read from `*_state` and the new ones written to
   `*_out` (never the same memory: the caller hands them to the cache, which commits them). */
#include <string.h>

#include "hc_internal.h"

static inline float silu_f(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One step of a depthwise causal conv of width K over C channels of B rows: window = [state (K-1 inputs, oldest
   first), xin], y[c] = sum_j window[j] * w[c, j] in order j = 0..K-1, + bias[c] (NULL: none), silu when act;
   state_out [B, C, K-1] = the window's last K-1. xin: row stride xs; y: row stride ys. */
static void conv_step(const float *xin, long xs, int B, int C, int K, const float *w, const float *bias,
                      const float *state, float *state_out, int act, float *y, long ys) {
  for (int b = 0; b < B; b++)
    for (int c = 0; c < C; c++) {
      const float *s = state + ((size_t)b * C + c) * (K - 1), *wc = w + (size_t)c * K;
      float *so = state_out + ((size_t)b * C + c) * (K - 1);
      float x = xin[b * xs + c];
      float acc = K > 1 ? s[0] * wc[0] : x * wc[0];
      for (int j = 1; j < K; j++) acc += (j < K - 1 ? s[j] : x) * wc[j];
      if (bias) acc += bias[c];
      y[b * ys + c] = act ? silu_f(acc) : acc;
      for (int j = 0; j + 1 < K - 1; j++) so[j] = s[j + 1];
      if (K > 1) so[K - 2] = x;
    }
}

/* LFM2 ShortConv, one token per row of x [B, D]: (b, c, u) = in_proj(x) [B, 3D] (thirds in that order), the conv
   step (no activation) of b * u with state [B, D, K-1] -> state_out, g = c * conv, y [B, D] = out_proj(g).
   scratch: [B, 5D] floats. */
void hc_short_conv_step(const float *x, int B, int D, int K, const void *w_in, int in_type, const float *in_scale,
                        const float *in_bias, const float *conv_w, const float *conv_b, const float *state,
                        float *state_out, const void *w_out, int out_type, const float *out_scale,
                        const float *out_bias, float *scratch, float *y) {
  float *proj = scratch, *bx = proj + (size_t)B * 3 * D, *g = bx + (size_t)B * D;
  linear_any(in_type, x, w_in, proj, in_scale, in_bias, B, 3 * D, D);
  for (int b = 0; b < B; b++)
    for (int d = 0; d < D; d++) bx[(size_t)b * D + d] = proj[(size_t)b * 3 * D + d] * proj[(size_t)b * 3 * D + 2 * D + d];
  conv_step(bx, D, B, D, K, conv_w, conv_b, state, state_out, 0, g, D);
  for (int b = 0; b < B; b++)
    for (int d = 0; d < D; d++) g[(size_t)b * D + d] *= proj[(size_t)b * 3 * D + D + d];
  linear_any(out_type, g, w_out, y, out_scale, out_bias, B, D, D);
}

/* The Mamba2 mixer, one token per row of x [B, Dm], with H heads of P channels (I = H P), G groups of state size N,
   conv width K over Cc = I + 2 G N channels:
     (z [I], xbc [Cc], dt [H]) = in_proj(x); xbc = silu(conv step(xbc)) with conv_state [B, Cc, K-1];
     (u [H, P], Bg [G, N], Cg [G, N]) = xbc; dt = clamp(softplus(dt + dt_bias), lo, hi); A = -exp(A_log);
     h[h, p, :] = exp(dt A) h + (u dt) Bg[g(h)], yh[p] = <h[h, p, :], Cg[g(h)]> + D[h] u   (ssm_state [B, H, P, N])
     gate: norm 0: yh * silu(z); 1: group RMSNorm (groups of I / G, eps) of yh * silu(z), times norm_w;
           2: the group RMSNorm of yh, times silu(z), times norm_w;
     y [B, Dm] = out_proj(gated).
   D may be NULL (no skip). scratch: [B, (2I + 2GN + H) + Cc + I] floats. */
void hc_mamba2_step(const float *x, int B, int Dm, int H, int P, int G, int N, int K, const void *w_in, int in_type,
                    const float *in_scale, const float *in_bias, const float *conv_w, const float *conv_b,
                    const float *conv_state, float *conv_out, const float *dt_bias, const float *A_log,
                    const float *Dskip, float dt_lo, float dt_hi, const float *ssm_state, float *ssm_out, int norm,
                    const float *norm_w, float norm_eps, const void *w_out, int out_type, const float *out_scale,
                    const float *out_bias, float *scratch, float *y) {
  int I = H * P, GN = G * N, Cc = I + 2 * GN, E = 2 * I + 2 * GN + H, R = H / G, gs = I / G;
  float *zx = scratch, *xbc = zx + (size_t)B * E, *gated = xbc + (size_t)B * Cc;
  linear_any(in_type, x, w_in, zx, in_scale, in_bias, B, E, Dm);
  conv_step(zx + I, E, B, Cc, K, conv_w, conv_b, conv_state, conv_out, 1, xbc, Cc);
  int wide = (size_t)B * H * P * N >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long bh = 0; bh < (long)B * H; bh++) {
    int b = (int)(bh / H), h = (int)(bh % H), g = h / R;
    float dt = softplus_f(zx[(size_t)b * E + I + Cc + h] + dt_bias[h]);
    dt = dt < dt_lo ? dt_lo : (dt > dt_hi ? dt_hi : dt);
    float decay = expf(dt * -expf(A_log[h]));
    const float *u = xbc + (size_t)b * Cc + (size_t)h * P, *Bv = xbc + (size_t)b * Cc + I + (size_t)g * N;
    const float *Cv = Bv + GN;
    for (int p = 0; p < P; p++) {
      size_t at = (((size_t)b * H + h) * P + p) * N;
      const float *s = ssm_state + at;
      float *so = ssm_out + at, du = u[p] * dt, acc = 0.0f;
      int n = 0;
#if VW > 1
      vf accv = vzero();
      for (; n + VW <= N; n += VW) {
        vf hv = vfma(vset1(decay), vload_f32(s + n), vmul(vset1(du), vload_f32(Bv + n)));
        vstore(so + n, hv);
        accv = vfma(hv, vload_f32(Cv + n), accv);
      }
      acc = vsum(accv);
#endif
      for (; n < N; n++) {
        so[n] = decay * s[n] + du * Bv[n];
        acc += so[n] * Cv[n];
      }
      gated[(size_t)b * I + (size_t)h * P + p] = acc + (Dskip ? Dskip[h] * u[p] : 0.0f);
    }
  }
  for (int b = 0; b < B; b++) {
    float *o = gated + (size_t)b * I;
    const float *z = zx + (size_t)b * E;
    if (norm != 2)
      for (int i = 0; i < I; i++) o[i] *= silu_f(z[i]);
    if (norm)
      for (int gi = 0; gi < G; gi++) {
        float *og = o + (size_t)gi * gs, ss = 0.0f;
        for (int i = 0; i < gs; i++) ss += og[i] * og[i];
        float r = 1.0f / sqrtf(ss / gs + norm_eps);
        for (int i = 0; i < gs; i++) {
          float v = og[i] * r;
          if (norm == 2) v *= silu_f(z[(size_t)gi * gs + i]);
          og[i] = norm_w[(size_t)gi * gs + i] * v;
        }
      }
  }
  linear_any(out_type, gated, w_out, y, out_scale, out_bias, B, Dm, I);
}

/* The Mamba1 mixer (Mamba, Jamba), one token per row of x [B, Dm], Di channels, state size N, conv width K, dt rank R:
     (u, z) = in_proj(x) [B, 2 Di] (halves); u = silu(conv step(u)) with conv_state [B, Di, K-1];
     (dt [R], Bv [N], Cv [N]) = x_proj(u), each through its RMSNorm where dt_norm / b_norm / c_norm are given
     (Jamba; hc_rms_norm with those effective scales); delta = dt_proj(dt) [Di] (no bias: dt_bias goes inside the
     softplus); the selective step of hc_selective_scan (T = 1) with A = -exp(A_log) [Di, N], D [Di], the gate
     silu(z): ssm_state [B, Di, N] -> ssm_out; y [B, Dm] = out_proj(that).
   scratch: [B, (2 Di) + Di + (R + 2N) + (R + 2N) + Di + Di + Di N] floats. */
void hc_mamba_step(const float *x, int B, int Dm, int Di, int N, int K, int R, const void *w_in, int in_type,
                   const float *in_scale, const float *in_bias, const float *conv_w, const float *conv_b,
                   const float *conv_state, float *conv_out, const void *w_x, int x_type, const float *x_scale,
                   const float *dt_norm, float dt_eps, const float *b_norm, float b_eps, const float *c_norm,
                   float c_eps, const void *w_dt, int dt_type, const float *dt_scale, const float *dt_bias,
                   const float *A_log, const float *Dskip, const float *ssm_state, float *ssm_out, const void *w_out,
                   int out_type, const float *out_scale, const float *out_bias, float *scratch, float *y) {
  int W = R + 2 * N;
  float *uz = scratch, *u = uz + (size_t)B * 2 * Di, *dbc = u + (size_t)B * Di, *dbc_n = dbc + (size_t)B * W;
  float *delta = dbc_n + (size_t)B * W, *gate = delta + (size_t)B * Di, *g = gate + (size_t)B * Di;
  float *A = g + (size_t)B * Di;
  linear_any(in_type, x, w_in, uz, in_scale, in_bias, B, 2 * Di, Dm);
  conv_step(uz, 2 * Di, B, Di, K, conv_w, conv_b, conv_state, conv_out, 1, u, Di);
  linear_any(x_type, u, w_x, dbc, x_scale, NULL, B, W, Di);
  for (int b = 0; b < B; b++) { /* the inner norms (Jamba), each over its own slice of the row */
    const float *src = dbc + (size_t)b * W;
    float *dst = dbc_n + (size_t)b * W;
    if (dt_norm) hc_rms_norm(src, dt_norm, dst, 1, R, dt_eps); else memcpy(dst, src, sizeof(float) * R);
    if (b_norm) hc_rms_norm(src + R, b_norm, dst + R, 1, N, b_eps); else memcpy(dst + R, src + R, sizeof(float) * N);
    if (c_norm) hc_rms_norm(src + R + N, c_norm, dst + R + N, 1, N, c_eps);
    else memcpy(dst + R + N, src + R + N, sizeof(float) * N);
  }
  /* dt_proj over the R-wide slices (row stride W: gathered into `gate` first, then reused for the gate) */
  for (int b = 0; b < B; b++) memcpy(gate + (size_t)b * R, dbc_n + (size_t)b * W, sizeof(float) * R);
  linear_any(dt_type, gate, w_dt, delta, dt_scale, NULL, B, Di, R);
  for (size_t i = 0; i < (size_t)B * Di; i++) gate[i] = silu_f(uz[(i / Di) * 2 * Di + Di + i % Di]);
  for (size_t i = 0; i < (size_t)Di * N; i++) A[i] = -expf(A_log[i]);
  hc_selective_scan(u, Di, Di, delta, Di, Di, gate, Di, Di, dbc_n + R, W, W, dbc_n + R + N, W, W, A, Dskip, dt_bias,
                    1, ssm_state, g, ssm_out, B, 1, Di, N);
  linear_any(out_type, g, w_out, y, out_scale, out_bias, B, Dm, Di);
}

/* Qwen3-Next's Gated DeltaNet mixer, one token per row of x [B, Dm]: Hk key heads of Dk, Hv = r Hk value heads of Dv,
   conv width K over Cc = 2 Hk Dk + Hv Dv channels:
     qkvz = in_proj_qkvz(x) [Hk (2 Dk + 2 r Dv)] (per key head g: q, k, its r value heads' v, their z), ba =
     in_proj_ba(x) [Hk (2 r)] (per key head: b of its r value heads, then a); mixed = (q | k | v) over all heads,
     through the conv step (silu, no bias) with conv_state [B, Cc, K-1];
     per value head h (key head h / r): q, k L2-normalised (eps 1e-6 inside the root), q times Dk^-1/2;
     beta = beta_scale sigmoid(b), decay = exp(-exp(A_log[h]) softplus(a + dt_bias[h]));
     S = decay S (rec_state [B, Hv, Dk, Dv]); S += k (beta (v - S^T k))^T; o = S^T q;
     o = norm_w * rms_norm(o) (per head, eps) * silu(z); y [B, Dm] = out_proj(o [Hv Dv]).
   The projections have no bias. scratch: [B, (2 Hk Dk + 2 Hv Dv) + 2 Hv + 2 Cc + 2 Hv Dv] floats. */
/* One head's delta rule for a token: So = S decayed (by `decay`, or per key channel by fk[d] when fk is given),
   dh = beta (v - So^T k~), So += k~ dh^T, oh = So^T q~ scale, with k~ = k rk and q~ = q rq (the L2-normalized key and
   query). dh [Dv] is scratch; the same operations in the same order for every delta mixer, so the same bits. */
static void delta_rule_head(const float *S, float *So, const float *q, const float *k, const float *v,
                            const float *fk, float decay, int Dk, int Dv, float rq, float rk, float scale, float beta,
                            float *dh, float *oh) {
  for (int e = 0; e < Dv; e++) dh[e] = 0.0f;
  for (int d = 0; d < Dk; d++) {
    float kd = k[d] * rk, f = fk ? fk[d] : decay;
    for (int e = 0; e < Dv; e++) {
      So[(size_t)d * Dv + e] = S[(size_t)d * Dv + e] * f;
      dh[e] += So[(size_t)d * Dv + e] * kd;
    }
  }
  for (int e = 0; e < Dv; e++) dh[e] = beta * (v[e] - dh[e]), oh[e] = 0.0f;
  for (int d = 0; d < Dk; d++) {
    float kd = k[d] * rk, qd = q[d] * rq * scale;
    for (int e = 0; e < Dv; e++) {
      float s = So[(size_t)d * Dv + e] + kd * dh[e];
      So[(size_t)d * Dv + e] = s;
      oh[e] += s * qd;
    }
  }
}

void hc_gated_delta_step(const float *x, int B, int Dm, int Hk, int Hv, int Dk, int Dv, int K, const void *w_qkvz,
                         int qkvz_type, const float *qkvz_scale, const void *w_ba, int ba_type, const float *ba_scale,
                         const float *conv_w, const float *conv_state, float *conv_out, const float *dt_bias,
                         const float *A_log, float beta_scale, const float *rec_state, float *rec_out,
                         const float *norm_w, float norm_eps, const void *w_out, int out_type, const float *out_scale,
                         float *scratch, float *y) {
  int r = Hv / Hk, G = 2 * Dk + 2 * r * Dv, E1 = Hk * G, E2 = 2 * Hv, KD = Hk * Dk, Cc = 2 * KD + Hv * Dv;
  int VD = Hv * Dv;
  float *qkvz = scratch, *ba = qkvz + (size_t)B * E1, *mixed = ba + (size_t)B * E2, *mc = mixed + (size_t)B * Cc;
  float *o = mc + (size_t)B * Cc, *dl = o + (size_t)B * VD;
  linear_any(qkvz_type, x, w_qkvz, qkvz, qkvz_scale, NULL, B, E1, Dm);
  linear_any(ba_type, x, w_ba, ba, ba_scale, NULL, B, E2, Dm);
  for (int b = 0; b < B; b++)
    for (int g = 0; g < Hk; g++) {
      const float *src = qkvz + (size_t)b * E1 + (size_t)g * G;
      float *dst = mixed + (size_t)b * Cc;
      memcpy(dst + (size_t)g * Dk, src, sizeof(float) * Dk);
      memcpy(dst + KD + (size_t)g * Dk, src + Dk, sizeof(float) * Dk);
      memcpy(dst + 2 * KD + (size_t)g * r * Dv, src + 2 * Dk, sizeof(float) * r * Dv);
    }
  conv_step(mixed, Cc, B, Cc, K, conv_w, NULL, conv_state, conv_out, 1, mc, Cc);
  float scale = 1.0f / sqrtf((float)Dk);
  int wide = (size_t)B * Hv * Dk * Dv >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long bh = 0; bh < (long)B * Hv; bh++) {
    int b = (int)(bh / Hv), h = (int)(bh % Hv), g = h / r, i = h % r;
    const float *q = mc + (size_t)b * Cc + (size_t)g * Dk, *k = q + KD, *v = mc + (size_t)b * Cc + 2 * KD + (size_t)h * Dv;
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < Dk; d++) sq += q[d] * q[d], sk += k[d] * k[d];
    float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    const float *bav = ba + (size_t)b * E2 + (size_t)g * 2 * r;
    float beta = beta_scale / (1.0f + expf(-bav[i]));
    float decay = expf(-expf(A_log[h]) * softplus_f(bav[r + i] + dt_bias[h]));
    const float *S = rec_state + (size_t)bh * Dk * Dv;
    float *So = rec_out + (size_t)bh * Dk * Dv, *oh = o + (size_t)bh * Dv, *dh = dl + (size_t)bh * Dv;
    delta_rule_head(S, So, q, k, v, NULL, decay, Dk, Dv, rq, rk, scale, beta, dh, oh);
    const float *z = qkvz + (size_t)b * E1 + (size_t)g * G + 2 * Dk + (size_t)r * Dv + (size_t)i * Dv;
    float ss = 0.0f;
    for (int e = 0; e < Dv; e++) ss += oh[e] * oh[e];
    float rn = 1.0f / sqrtf(ss / Dv + norm_eps);
    for (int e = 0; e < Dv; e++) oh[e] = norm_w[e] * (oh[e] * rn) * silu_f(z[e]);
  }
  linear_any(out_type, o, w_out, y, out_scale, NULL, B, Dm, VD);
}

/* The delta-rule mixers whose projections are separate matrices (Qwen3.5, OLMo-Hybrid, Kimi's and Bailing's KDA),
   one token per row of x [B, Dm]. Hk key heads of Dk, Hv = r Hk value heads of Dv; KD = Hk Dk, VD = Hv Dv.
   P projections (no bias): projection j reads x (src[j] < 0, Dm columns) or the output of an earlier one src[j] (a
   low-rank pair: its rows are the columns), and writes its own block [B, rows[j]] of the scratch. The first n_qkv
   outputs in order are the conv input [q (KD) | k (KD) | v (VD)] (Cc = 2 KD + VD channels): each through its own
   depthwise conv step (conv_w[j] [rows[j], K], silu, no bias) with conv_state [B, Cc, K-1] -> conv_out.
   Projection iz gives the output gate z [VD], ib beta's logits [Hv], ia the decay's logits a:
     beta = beta_scale sigmoid(b);
     decay 0 (per head, a [Hv], dt_bias [Hv]):          g = -exp(A_log[h]) softplus(a + dt_bias);
     decay 1 (per key channel, a / dt_bias [Hv Dk]):    g = -exp(A_log[h]) softplus(a + dt_bias);
     decay 2 (per key channel, bounded):               g = lower_bound sigmoid(exp(A_log[h]) (a + dt_bias));
     per value head h (key head h / r): q, k L2-normalised (eps 1e-6 inside the root), q times Dk^-1/2;
     S = exp(g) S (per key channel: row d of S times exp(g[d])) (rec_state [B, Hv, Dk, Dv] -> rec_out);
     S += k (beta (v - S^T k))^T; o = S^T q;
     o = norm_w * rms_norm(o) (per head, eps) * (gate 0: silu(z), 1: sigmoid(z)); y [B, Dm] = out_proj(o).
   scratch: [B, (sum of rows) + Cc + 2 VD + Hv Dk] floats. */
void hc_delta_step(const float *x, int B, int Dm, int Hk, int Hv, int Dk, int Dv, int K, int P, const void *const *w,
                   const int *types, const void *const *scales, const int *rows, const int *src, int n_qkv,
                   const void *const *conv_w, const float *conv_state, float *conv_out, int iz, int ib, int ia,
                   int decay, float lower_bound, const float *dt_bias, const float *A_log, float beta_scale,
                   const float *rec_state, float *rec_out, int gate, const float *norm_w, float norm_eps,
                   const void *w_out, int out_type, const float *out_scale, float *scratch, float *y) {
  int r = Hv / Hk, KD = Hk * Dk, VD = Hv * Dv, Cc = 2 * KD + VD;
  float *outs[8];
  if (P < 1 || P > 8) return; /* (the wrapper refuses more; outs is indexed below its constant bound only) */
  size_t at = 0;
  for (int j = 0; j < P; j++) outs[j] = scratch + at, at += (size_t)B * rows[j];
  float *mc = scratch + at, *o = mc + (size_t)B * Cc, *dl = o + (size_t)B * VD, *gk = dl + (size_t)B * VD;
  for (int j = 0; j < P; j++) {
    int from = src[j];
    linear_any(types[j], from < 0 ? x : outs[from], w[j], outs[j], (const float *)scales[j], NULL, B, rows[j],
               from < 0 ? Dm : rows[from]);
  }
  for (int b = 0; b < B; b++)
    for (int j = 0, c0 = 0; j < n_qkv; c0 += rows[j], j++) {
      size_t st = ((size_t)b * Cc + c0) * (K - 1);
      conv_step(outs[j] + (size_t)b * rows[j], rows[j], 1, rows[j], K, (const float *)conv_w[j], NULL,
                conv_state + st, conv_out + st, 1, mc + (size_t)b * Cc + c0, Cc);
    }
  float scale = 1.0f / sqrtf((float)Dk);
  int wide = (size_t)B * Hv * Dk * Dv >= PARALLEL_BYTES / 4, wa = decay == 0 ? Hv : Hv * Dk;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long bh = 0; bh < (long)B * Hv; bh++) {
    int b = (int)(bh / Hv), h = (int)(bh % Hv), g = h / r;
    const float *q = mc + (size_t)b * Cc + (size_t)g * Dk, *k = q + KD, *v = mc + (size_t)b * Cc + 2 * KD + (size_t)h * Dv;
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < Dk; d++) sq += q[d] * q[d], sk += k[d] * k[d];
    float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    float beta = beta_scale / (1.0f + expf(-outs[ib][(size_t)b * Hv + h]));
    const float *a = outs[ia] + (size_t)b * wa;
    float *fk = gk + (size_t)bh * Dk; /* the forget factor of each key channel */
    if (decay == 0) {
      float f = expf(-expf(A_log[h]) * softplus_f(a[h] + dt_bias[h]));
      for (int d = 0; d < Dk; d++) fk[d] = f;
    } else
      for (int d = 0; d < Dk; d++) {
        float ad = a[(size_t)h * Dk + d] + dt_bias[(size_t)h * Dk + d];
        float lg = decay == 1 ? -expf(A_log[h]) * softplus_f(ad) : lower_bound / (1.0f + expf(-expf(A_log[h]) * ad));
        fk[d] = expf(lg);
      }
    const float *S = rec_state + (size_t)bh * Dk * Dv;
    float *So = rec_out + (size_t)bh * Dk * Dv, *oh = o + (size_t)bh * Dv, *dh = dl + (size_t)bh * Dv;
    delta_rule_head(S, So, q, k, v, fk, 0.0f, Dk, Dv, rq, rk, scale, beta, dh, oh);
    const float *z = outs[iz] + (size_t)b * VD + (size_t)h * Dv;
    float ss = 0.0f;
    for (int e = 0; e < Dv; e++) ss += oh[e] * oh[e];
    float rn = 1.0f / sqrtf(ss / Dv + norm_eps);
    for (int e = 0; e < Dv; e++)
      oh[e] = norm_w[e] * (oh[e] * rn) * (gate == 0 ? silu_f(z[e]) : 1.0f / (1.0f + expf(-z[e])));
  }
  linear_any(out_type, o, w_out, y, out_scale, NULL, B, Dm, VD);
}

/* RecurrentGemma's recurrent block (Griffin), one token per row of x [B, Dm], LRU width W in H blocks of bw = W / H:
     yb = gelu_tanh(linear_y(x)) [W]; xw = linear_x(x) [W], through the conv step (bias, no activation) with
     conv_state [B, W, K-1] -> xc; per block: ig = sigmoid(xc_h ig_w[h] + ig_b[h]), rg likewise (weights [H, bw, bw],
     input index first: out[j] = sum_i xc[i] w[h, i, j]);
     log_a = -8 rg softplus(recurrent_param); a = exp(log_a), m = sqrt(1 - exp(2 log_a)); at a row's first token
     (pos[b] == 0, pos [B]: the token's position) a = 0 and m = 1; lru_out = (xc ig m) + a lru (lru_state [B, W]); y [B, Dm] = linear_out(lru_out
     yb). The projections are biased (NULL: none). scratch: [B, 4 W] + [W] floats. */
void hc_rglru_step(const float *x, int B, int Dm, int W, int H, int K, const void *w_y, int y_type,
                   const float *y_scale, const float *y_bias, const void *w_x, int x_type, const float *x_scale,
                   const float *x_bias, const float *conv_w, const float *conv_b, const float *conv_state,
                   float *conv_out, const float *ig_w, const float *ig_b, const float *rg_w, const float *rg_b,
                   const float *rec_param, const int64_t *pos, const float *lru_state, float *lru_out,
                   const void *w_out, int out_type, const float *out_scale, const float *out_bias, float *scratch,
                   float *y) {
  int bw = W / H;
  float *yb = scratch, *xw = yb + (size_t)B * W, *xc = xw + (size_t)B * W, *g = xc + (size_t)B * W;
  float *rg = g + (size_t)B * W; /* one block's recurrence gate logits */
  const float c = 0.7978845608028654f, c3 = 0.044715f;
  linear_any(y_type, x, w_y, yb, y_scale, y_bias, B, W, Dm);
  linear_any(x_type, x, w_x, xw, x_scale, x_bias, B, W, Dm);
  conv_step(xw, W, B, W, K, conv_w, conv_b, conv_state, conv_out, 0, xc, W);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++) {
      const float *xh = xc + (size_t)b * W + (size_t)h * bw;
      float *ig = g + (size_t)b * W + (size_t)h * bw; /* the input gate's logits, then the gated output */
      for (int j = 0; j < bw; j++) ig[j] = ig_b[(size_t)h * bw + j], rg[j] = rg_b[(size_t)h * bw + j];
      for (int i = 0; i < bw; i++) {
        const float *wi = ig_w + ((size_t)h * bw + i) * bw, *wr = rg_w + ((size_t)h * bw + i) * bw;
        float xi = xh[i];
        for (int j = 0; j < bw; j++) ig[j] += xi * wi[j], rg[j] += xi * wr[j];
      }
      for (int j = 0; j < bw; j++) {
        size_t at = (size_t)b * W + (size_t)h * bw + j;
        float ri = 1.0f / (1.0f + expf(-rg[j])), ii = 1.0f / (1.0f + expf(-ig[j]));
        float log_a = -8.0f * ri * softplus_f(rec_param[(size_t)h * bw + j]);
        float a = pos[b] == 0 ? 0.0f : expf(log_a), m = pos[b] == 0 ? 1.0f : sqrtf(1.0f - expf(2.0f * log_a));
        float hn = xh[j] * ii * m + a * lru_state[at];
        lru_out[at] = hn;
        float u = yb[at], z = 2.0f * c * (u + c3 * u * u * u);
        g[at] = hn * (u / (1.0f + expf(-z)));
      }
    }
  linear_any(out_type, g, w_out, y, out_scale, out_bias, B, Dm, W);
}

/* Zamba's Mamba1 mixer, one token per row of x [B, Dm]: hc_mamba_step's mixer over G channel groups of Dh = Di / G,
   each with its own float32 x_proj (x_w [G, R + 2N, Dh]) and dt_proj (dt_w [G, Dh, R]), and its own B and C:
     (u, z) = in_proj(x) [B, Di, 2] (interleaved per channel); u = silu(conv step(u)) with conv_state [B, Di, K-1];
     per group: (dt [R], Bv [N], Cv [N]) = x_w[g] u_g; delta = softplus(dt_w[g] dt + dt_bias) [Dh];
     h[c, :] = exp(delta A[c, :]) h[c, :] + delta u Bv, yc = (<h[c, :], Cv> + D[c] u) silu(z)  (A = -exp(A_log)
     [Di, N], ssm_state [B, Di, N] -> ssm_out); y [B, Dm] = out_proj(that).
   scratch: [B, 2 Di + Di + Di + G (R + 2N) + Di + Di] floats. */
void hc_mamba_groups_step(const float *x, int B, int Dm, int Di, int N, int K, int R, int G, const void *w_in,
                          int in_type, const float *in_scale, const float *in_bias, const float *conv_w,
                          const float *conv_b, const float *conv_state, float *conv_out, const float *x_w,
                          const float *dt_w, const float *dt_bias, const float *A_log, const float *Dskip,
                          const float *ssm_state, float *ssm_out, const void *w_out, int out_type,
                          const float *out_scale, const float *out_bias, float *scratch, float *y) {
  int Dh = Di / G, W = R + 2 * N;
  float *uz = scratch, *ui = uz + (size_t)B * 2 * Di, *u = ui + (size_t)B * Di, *dbc = u + (size_t)B * Di;
  float *delta = dbc + (size_t)B * G * W, *g = delta + (size_t)B * Di;
  linear_any(in_type, x, w_in, uz, in_scale, in_bias, B, 2 * Di, Dm);
  for (size_t i = 0; i < (size_t)B * Di; i++) ui[i] = uz[2 * i];
  conv_step(ui, Di, B, Di, K, conv_w, conv_b, conv_state, conv_out, 1, u, Di);
  for (int b = 0; b < B; b++)
    for (int gi = 0; gi < G; gi++) {
      float *p = dbc + ((size_t)b * G + gi) * W;
      hc_linear_f32(u + (size_t)b * Di + (size_t)gi * Dh, x_w + (size_t)gi * W * Dh, p, NULL, NULL, 1, W, Dh);
      hc_linear_f32(p, dt_w + (size_t)gi * Dh * R, delta + (size_t)b * Di + (size_t)gi * Dh, NULL, NULL, 1, Dh, R);
    }
  for (int b = 0; b < B; b++)
    for (int c = 0; c < Di; c++) {
      size_t i = (size_t)b * Di + c;
      const float *Bv = dbc + ((size_t)b * G + c / Dh) * W + R, *Cv = Bv + N, *s = ssm_state + i * N;
      float *so = ssm_out + i * N, dt = softplus_f(delta[i] + dt_bias[c]), du = dt * u[i], acc = 0.0f;
      for (int n = 0; n < N; n++) {
        so[n] = expf(dt * -expf(A_log[(size_t)c * N + n])) * s[n] + du * Bv[n];
        acc += so[n] * Cv[n];
      }
      g[i] = (acc + (Dskip ? Dskip[c] * u[i] : 0.0f)) * silu_f(uz[2 * i + 1]);
    }
  linear_any(out_type, g, w_out, y, out_scale, out_bias, B, Dm, Di);
}

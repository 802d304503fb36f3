/* Prefill projections, x [M, K] @ w [N, K]^T for many rows: hc_gemm_f32 / hc_gemm_bf16 / hc_gemm_i8. */
#include "hc_internal.h"

/* ---- prefill projections: x [M, K] @ w [N, K]^T for many rows (a real GEMM) ---------------------------------------
   Outer products on a packed panel: each thread takes panels of NR = 2 VW weight rows, widens them (bfloat16 / int8:
   once per panel, not per row of x) into [K, NR] floats (per-thread scratch, kept), then sweeps x MR rows at a time,
   MR x NR sums in registers over all K (12 of avx2's 16 vector registers). Measured on a 2-core AMD EPYC (avx2), 128
   rows, Gemma 3 270M's projections: see the README. */
#define GEMM_MR 6
#define GEMM_NR (2 * VW)
#ifndef GEMM_KC
#define GEMM_KC 512
#endif
static __thread float *panel_f = NULL;
static __thread size_t panel_n = 0;

static float *panel(size_t n) { return grow(&panel_f, &panel_n, n); }

/* MR rows of x from m0, columns [k0, k0 + kc), times the packed panel p [kc, NR], added to the sums so far in
   y[m0 .., n0 .. n0 + nr) (first: none yet); the last block of K scales and adds the bias. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, const float *p, float *y,
                                                            const float *scale, const float *bias, int MR, int K,
                                                            int N, int m0, int n0, int nr, int k0, int kc,
                                                            int first, int last) {
  vf acc[GEMM_MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = vzero();
  const float *xr[GEMM_MR];
  for (int i = 0; i < MR; i++) xr[i] = x + (size_t)(m0 + i) * K + k0;
#pragma GCC unroll 4 /* measured ~6% faster than gcc's own choice (2-core AMD EPYC, avx2) */
  for (int k = 0; k < kc; k++) {
    vf b0 = vload_f32(p + (size_t)k * GEMM_NR), b1 = vload_f32(p + (size_t)k * GEMM_NR + VW);
    for (int i = 0; i < MR; i++) {
      vf a = vset1(xr[i][k]);
      acc[i][0] = vfma(a, b0, acc[i][0]);
      acc[i][1] = vfma(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; i++) {
    float out[GEMM_NR];
    vstore(out, acc[i][0]);
    vstore(out + VW, acc[i][1]);
    float *yr = y + (size_t)(m0 + i) * N + n0;
    for (int j = 0; j < nr; j++) {
      float s = first ? out[j] : yr[j] + out[j];
      if (last && scale) s *= scale[n0 + j];
      if (last && bias) s += bias[n0 + j];
      yr[j] = s;
    }
  }
}

#define GEMM_TILE(MRC) gemm_tile(x, p, y, scale, bias, MRC, K, N, m0, n0, nr, k0, kc, k0 == 0, k0 + kc == K)
#define GEMM(NAME, WT, SLOAD)                                                                                   \
  int NAME(const float *x, const WT *w, float *y, const float *scale, const float *bias, int M, int N, int K) { \
    int panels = (N + GEMM_NR - 1) / GEMM_NR, failed = 0;                                                      \
    _Pragma("omp parallel for schedule(static) reduction(|| : failed)") for (int pi = 0; pi < panels; pi++) {  \
      float *p = panel((size_t)GEMM_KC * GEMM_NR);                                                             \
      if (!p) {                                                                                                \
        failed = 1;                                                                                            \
        continue;                                                                                              \
      }                                                                                                        \
      int n0 = pi * GEMM_NR, nr = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;                                         \
      const WT *w0 = w + (size_t)n0 * K;                                                                       \
      for (int k0 = 0; k0 < K; k0 += GEMM_KC) {                                                                \
        int kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;                                                          \
        for (int k = 0; k < kc; k++) {                                                                         \
          float *pk = p + (size_t)k * GEMM_NR;                                                                 \
          for (int j = 0; j < nr; j++) pk[j] = SLOAD(w0 + (size_t)j * K + k0 + k);                             \
          for (int j = nr; j < GEMM_NR; j++) pk[j] = 0.0f;                                                     \
        }                                                                                                      \
        int m0 = 0;                                                                                            \
        for (; m0 + GEMM_MR <= M; m0 += GEMM_MR) GEMM_TILE(GEMM_MR);                                           \
        switch (M - m0) {                                                                                      \
          case 5: GEMM_TILE(5); break;                                                                         \
          case 4: GEMM_TILE(4); break;                                                                         \
          case 3: GEMM_TILE(3); break;                                                                         \
          case 2: GEMM_TILE(2); break;                                                                         \
          case 1: GEMM_TILE(1); break;                                                                         \
          default: break;                                                                                      \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    return failed ? -1 : 0;                                                                                    \
  }

GEMM(hc_gemm_f32, float, sload_f32)
GEMM(hc_gemm_bf16, uint16_t, sload_bf16)
GEMM(hc_gemm_i8, int8_t, sload_i8)

/* ---- q8_0 prefill (hc_linear_q8_0 with more than Q8_GEMM_MIN_ROWS - 1 rows, avx2) --------------------------------
   The quantized activations and weights are integers of at most 127 in magnitude, so in float32 each product
   (<= 16129) and each block's sum of 32 of them (< 2^24) is exact: a block's float32 sum of products IS its int32 sum.
   So the prefill runs as the float GEMM above (panels of 16 weight rows widened to float once per call with two
   8 x 8 transposes, 6 x 16 block sums in registers: 12 independent multiply-add chains, one x broadcast per pair)
   with one more step per block of 32: the block's exact sums times (d_x * d_w) added to running totals kept in
   memory (a multiply and a multiply-add per vector and block: 1/16 of the FMAs). The integer kernel spends ~7 vector
   operations per block and (weight row, x row) pair (sign, two multiply-adds, its share of the horizontal adds, the
   conversion and scaling), a third of them horizontal adds; here 2 FMAs per 16 products. Measured on the 2-core AMD
   EPYC (avx2), one thread, Gemma 3 270M's four layer matrices at 128 rows, ABBA in one process
   (experiments/benchmark/standalone/kernel_ab.py): 25.7 -> 31.1 G multiply-adds/s, 1.18-1.26x (with scalar
   widening: 1.04x; a 3 x 16 tile with its totals in registers, 6 chains: 0.90x; a 4 x 2 integer tile sharing the
   scales: 1.00x). The blocks' sums are the same integers; the float32 totals add the blocks one by one (the
   integer kernel: 4 blocks per lane, then the lanes), so results match it to rounding, not bit for bit. */
#if VW == 8
#define Q8G_MR 6 /* 6 x 2 block sums (12 independent multiply-add chains), 2 weight vectors and x in registers */
static __thread float *q8g_x = NULL, *q8g_p = NULL; /* x as floats; a panel with its scales */
static __thread size_t q8g_xn = 0, q8g_pn = 0;

/* MR rows of x (as floats) from m0 times the panel p [K, NR] with its block scales ps [G, NR]: y [m0 .., n0 .. n0 +
   nr) (+ bias). The running totals live in memory (touched once per block). */
static inline __attribute__((always_inline)) void q8g_tile(const float *xf, const float *xd, const float *p,
                                                           const float *ps, const float *bias, float *y, int MR,
                                                           int K, int G, int N, int m0, int n0, int nr) {
  float tot[Q8G_MR][GEMM_NR] __attribute__((aligned(64)));
  const float *xr[Q8G_MR];
  for (int i = 0; i < MR; i++) {
    vstore(tot[i], vzero());
    vstore(tot[i] + VW, vzero());
    xr[i] = xf + (size_t)(m0 + i) * K;
  }
  for (int b = 0; b < G; b++) {
    vf blk[Q8G_MR][2];
    for (int i = 0; i < MR; i++) blk[i][0] = blk[i][1] = vzero();
    const float *pb = p + (size_t)b * Q8_BLOCK * GEMM_NR;
#pragma GCC unroll 4
    for (int k = 0; k < Q8_BLOCK; k++) {
      vf b0 = vload_f32(pb + (size_t)k * GEMM_NR), b1 = vload_f32(pb + (size_t)k * GEMM_NR + VW);
      for (int i = 0; i < MR; i++) {
        vf a = vset1(xr[i][(size_t)b * Q8_BLOCK + k]);
        blk[i][0] = vfma(a, b0, blk[i][0]);
        blk[i][1] = vfma(a, b1, blk[i][1]);
      }
    }
    vf s0 = vload_f32(ps + (size_t)b * GEMM_NR), s1 = vload_f32(ps + (size_t)b * GEMM_NR + VW);
    for (int i = 0; i < MR; i++) {
      vf dx = vset1(xd[(size_t)(m0 + i) * G + b]);
      vstore(tot[i], vfma(blk[i][0], vmul(dx, s0), vload_f32(tot[i])));
      vstore(tot[i] + VW, vfma(blk[i][1], vmul(dx, s1), vload_f32(tot[i] + VW)));
    }
  }
  for (int i = 0; i < MR; i++) {
    float *yr = y + (size_t)(m0 + i) * N + n0;
    for (int j = 0; j < nr; j++) yr[j] = bias ? tot[i][j] + bias[n0 + j] : tot[i][j];
  }
}

/* r[j] (row j's 8 values) -> r[c] (column c's 8 values) */
static inline __attribute__((always_inline)) void transpose8(__m256 *r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) { /* rows 4i .. 4i + 3 */
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; c++) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

/* y [M, N] from the quantized rows xq [M, K] / scales xd [M, G] (M <= Q8G_CHUNK); 0, or -1 (nothing usable
   written) without scratch memory. */
static int q8_gemm_rows(const int8_t *xq, const float *xd, const int8_t *w, const uint16_t *scale, const float *bias,
                        float *y, int M, int N, int K) {
  int G = K / Q8_BLOCK;
  float *xf = grow(&q8g_x, &q8g_xn, (size_t)M * K);
  if (!xf) return -1;
  for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = (float)xq[i];
  int panels = (N + GEMM_NR - 1) / GEMM_NR, failed = 0;
#pragma omp parallel for schedule(static) reduction(|| : failed)
  for (int pi = 0; pi < panels; pi++) {
    float *p = grow(&q8g_p, &q8g_pn, ((size_t)K + G) * GEMM_NR);
    if (!p) {
      failed = 1;
      continue;
    }
    float *ps = p + (size_t)K * GEMM_NR;
    int n0 = pi * GEMM_NR, nr = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
    for (int k = 0; k < K; k += 8) /* 8 columns of the 16 rows: widened, then two 8 x 8 transposes */
      for (int h = 0; h < 2; h++) {
        __m256 r[8];
        for (int j = 0; j < 8; j++)
          r[j] = 8 * h + j < nr ? vload_i8(w + (size_t)(n0 + 8 * h + j) * K + k) : _mm256_setzero_ps();
        transpose8(r);
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(p + (size_t)(k + c) * GEMM_NR + 8 * h, r[c]);
      }
    for (int b = 0; b < G; b++)
      for (int j = 0; j < GEMM_NR; j++)
        ps[(size_t)b * GEMM_NR + j] = j < nr ? half_to_float(scale[(size_t)(n0 + j) * G + b]) : 0.0f;
    int m0 = 0;
    for (; m0 + Q8G_MR <= M; m0 += Q8G_MR) q8g_tile(xf, xd, p, ps, bias, y, Q8G_MR, K, G, N, m0, n0, nr);
    switch (M - m0) {
      case 5: q8g_tile(xf, xd, p, ps, bias, y, 5, K, G, N, m0, n0, nr); break;
      case 4: q8g_tile(xf, xd, p, ps, bias, y, 4, K, G, N, m0, n0, nr); break;
      case 3: q8g_tile(xf, xd, p, ps, bias, y, 3, K, G, N, m0, n0, nr); break;
      case 2: q8g_tile(xf, xd, p, ps, bias, y, 2, K, G, N, m0, n0, nr); break;
      case 1: q8g_tile(xf, xd, p, ps, bias, y, 1, K, G, N, m0, n0, nr); break;
      default: break;
    }
  }
  return failed ? -1 : 0;
}

/* Q8G_CHUNK rows of x at a time, so x's float copy stays <= Q8G_CHUNK x K floats however long the prompt; each chunk
   widens the panels again (once per 512 rows). */
#define Q8G_CHUNK 512
static int q8_gemm(const int8_t *xq, const float *xd, const int8_t *w, const uint16_t *scale, const float *bias,
                   float *y, int M, int N, int K) {
  size_t G = (size_t)K / Q8_BLOCK;
  for (int c0 = 0; c0 < M; c0 += Q8G_CHUNK) {
    int mc = M - c0 < Q8G_CHUNK ? M - c0 : Q8G_CHUNK;
    if (q8_gemm_rows(xq + (size_t)c0 * K, xd + (size_t)c0 * G, w, scale, bias, y + (size_t)c0 * N, mc, N, K)) return -1;
  }
  return 0;
}
#endif

/* Small-batch linear layers for CPU decode: y[M, N] = x[M, K] @ w[N, K]^T (* scale[N]) (+ bias[N]),
   hc_linear_f32 / hc_linear_bf16 / hc_linear_i8.

   A decode step multiplies a few rows (M = the batch) by every weight matrix once, so its speed is the speed at
   which the weights stream from memory. BLAS gemv/gemm kernels for M = 1..16 reach only part of that (and need the
   weights in float32); this kernel reads each weight row once for all M rows of x, converts int8 / bfloat16
   weights to float32 in registers, and accumulates in float32. Rows of w are split over OpenMP threads (the
   runtime torch itself uses). */
#include "hc_internal.h"

/* Software prefetch, PF rows of w ahead (into L2): a tile reads R short rows at once, and the hardware prefetcher
   alone reaches about half the read bandwidth on int8 / bfloat16 rows (measured: int8 262k x 640 head 11.6 ->
   6.5 ms with it). The batch-1 tile prefetches linearly instead, PF_TILES tiles ahead (below). */
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
#ifndef PF_TILES
#define PF_TILES 2
#endif

/* R rows of w times MT rows of x (R * MT <= 16), all K columns: the R * MT float32 sums stay in registers. Each
   weight vector is loaded (and converted) once for the MT rows of x: a batch of 8 takes R = 2, MT = 8, so the
   conversions of int8 / bfloat16 weights cost 1/8 of the multiply-adds. */
#define TILE(NAME, WT, VLOAD, SLOAD, PF)                                                                        \
  static inline __attribute__((always_inline)) void NAME(const float *x, const WT *w, float *y, const float *scale, \
                                                         const float *bias, int MT, int R, int N, int K, int n,     \
                                                         int m0) {                                                  \
    vf acc[16];                                                                                                     \
    for (int i = 0; i < 16; i++) acc[i] = vzero();                                                                  \
    const WT *wr[4];                                                                                                \
    for (int r = 0; r < R; r++) wr[r] = w + (size_t)(n + r) * K;                                                    \
    const float *xm[8];                                                                                             \
    for (int m = 0; m < MT; m++) xm[m] = x + (size_t)(m0 + m) * K;                                                  \
    int k = 0;                                                                                                      \
    for (; k + VW <= K; k += VW) {                                                                                  \
      vf wv[4];                                                                                                     \
      for (int r = 0; r < R; r++) {                                                                                 \
        if (PF) __builtin_prefetch(wr[r] + k + PF * (size_t)K, 0, PF_LOCALITY);                                    \
        wv[r] = VLOAD(wr[r] + k);                                                                                   \
      }                                                                                                             \
      for (int m = 0; m < MT; m++) {                                                                                \
        vf xv = vload_f32(xm[m] + k);                                                                               \
        for (int r = 0; r < R; r++) acc[r * MT + m] = vfma(wv[r], xv, acc[r * MT + m]);                             \
      }                                                                                                             \
    }                                                                                                               \
    float sums[16];                                                                                                 \
    TILE_SUMS(acc, sums, R * MT);                                                                                   \
    for (int r = 0; r < R; r++)                                                                                     \
      for (int m = 0; m < MT; m++) {                                                                                \
        float s = sums[r * MT + m];                                                                                 \
        for (int kk = k; kk < K; kk++) s += SLOAD(wr[r] + kk) * xm[m][kk];                                          \
        if (scale) s *= scale[n + r];                                                                               \
        if (bias) s += bias[n + r];                                                                                 \
        y[(size_t)(m0 + m) * N + n + r] = s;                                                                        \
      }                                                                                                             \
  }

/* Every (R, MT) combination as a constant, so the compiler keeps the tile's sums in registers. avx2 has 16 vector
   registers: a tile needs R * MT sums + R weight vectors + one x vector, so from 3 rows of x on it takes 2 weight
   rows (a 4 x 4 tile spills: 21 registers), up to 6 rows of x in one pass, 7-8 as two passes of 4 (measured on a
   2-core AMD EPYC, one thread, float32 weights from L3: 3-8 rows of x 33 -> 48-51 GFLOP/s, the 262k x 640 head from
   DRAM at 8 rows 28 -> 37-40; bfloat16 at 4 rows 38 -> 51; int8 / bfloat16 at 8 rows: 4096 x 640 5.2-6.3 -> 8.1
   GB/s int8, 10.8-12.8 -> 15 bfloat16), and 9-16 rows measured faster in passes of 8 than of 4. avx512 (32
   registers) keeps 4 weight rows up to 4 rows of x (float32: always). Each sum runs over k in the same order
   whatever the tile, so the tile never changes a result (checked bit for bit against the previous tiling). */
#define TILE_CASE(NAME, MTC, R, NN) \
  case MTC: NAME##_tile(x, w, y, scale, bias, MTC, R, N, K, NN, m0); break;
#define TILE_CASES4(NAME, R, NN) \
  switch (MT) { TILE_CASE(NAME, 1, R, NN) TILE_CASE(NAME, 2, R, NN) TILE_CASE(NAME, 3, R, NN) \
                default: NAME##_tile(x, w, y, scale, bias, 4, R, N, K, NN, m0); break; }
#define TILE_CASES8(NAME, R, NN)                                                                        \
  switch (MT) { TILE_CASE(NAME, 1, R, NN) TILE_CASE(NAME, 2, R, NN) TILE_CASE(NAME, 3, R, NN)         \
                TILE_CASE(NAME, 4, R, NN) TILE_CASE(NAME, 5, R, NN) TILE_CASE(NAME, 6, R, NN)         \
                TILE_CASE(NAME, 7, R, NN) default: NAME##_tile(x, w, y, scale, bias, 8, R, N, K, NN, m0); break; }
/* Batch 1 (M = 1), 4 weight rows per tile, the decode step of one sequence. Two sums per row, so a row's
   multiply-adds do not all wait on one another, and one software prefetch per 64 bytes read: a thread's tiles are
   consecutive rows, i.e. one contiguous stretch of w, so it prefetches the bytes PF_TILES tiles ahead in order
   rather than PF rows ahead per row (measured on a 2-core AMD EPYC, avx2, Gemma 3's 262k x 640 head: int8 15 ->
   20 GB/s, bfloat16 17 -> 20, medians of 6; float32, already at ~23 of the ~25 a streaming read reaches there, came
   out 3% slower, so it keeps the general tile). Prefetch addresses are integers: a prefetch never faults, and past
   the end of w it reads nothing we use. */
#define TILE1(NAME, WT, VLOAD, SLOAD)                                                                            \
  static inline __attribute__((always_inline)) void NAME(const float *x, const WT *w, float *y, const float *scale, \
                                                         const float *bias, int K, int n) {                        \
    vf acc[8];                                                                                                      \
    for (int i = 0; i < 8; i++) acc[i] = vzero();                                                                   \
    const WT *w0 = w + (size_t)n * K;                                                                               \
    const uintptr_t ahead = (uintptr_t)w0 + (uintptr_t)PF_TILES * 4 * (size_t)K * sizeof(WT);                     \
    int k = 0;                                                                                                      \
    for (; k + 2 * VW <= K; k += 2 * VW) {                                                                          \
      for (size_t b_ = 0; b_ < 8 * VW * sizeof(WT); b_ += 64) /* this step reads 4 rows x 2 VW weights */          \
        __builtin_prefetch((const void *)(ahead + 4 * (size_t)k * sizeof(WT) + b_), 0, PF_LOCALITY);                \
      vf x0 = vload_f32(x + k), x1 = vload_f32(x + k + VW);                                                         \
      for (int r = 0; r < 4; r++) {                                                                                 \
        acc[2 * r] = vfma(VLOAD(w0 + (size_t)r * K + k), x0, acc[2 * r]);                                           \
        acc[2 * r + 1] = vfma(VLOAD(w0 + (size_t)r * K + k + VW), x1, acc[2 * r + 1]);                              \
      }                                                                                                             \
    }                                                                                                               \
    if (k + VW <= K) {                                                                                              \
      vf x0 = vload_f32(x + k);                                                                                     \
      for (int r = 0; r < 4; r++) acc[2 * r] = vfma(VLOAD(w0 + (size_t)r * K + k), x0, acc[2 * r]);                \
      k += VW;                                                                                                      \
    }                                                                                                               \
    for (int r = 0; r < 4; r++) {                                                                                   \
      float s = vsum(acc[2 * r]) + vsum(acc[2 * r + 1]);                                                            \
      for (int kk = k; kk < K; kk++) s += SLOAD(w0 + (size_t)r * K + kk) * x[kk];                                   \
      if (scale) s *= scale[n + r];                                                                                 \
      if (bias) s += bias[n + r];                                                                                   \
      y[n + r] = s;                                                                                                 \
    }                                                                                                               \
  }

/* float32 at batch 1 on avx2: one row at a time, four sums over k (k = 0, 8, 16, 24 mod 32, added as (s0 + s1) +
   (s2 + s3)), no software prefetch: a thread's rows are one contiguous stretch of w, read in order as one stream, which
   the hardware prefetcher follows at the read's full rate, where the 4-row tile reads 4 streams 1 row apart and needs
   a prefetch per load (measured on the 2-core AMD EPYC, avx2, one thread, Gemma 3 270M's decode matrices in order, ABBA
   in one process, experiments/benchmark/standalone/kernel_ab.py: 79% -> 94-98% of the read, 1.19-1.24x; an 8-row tile
   with one sum per row, which keeps the bits: 1.06-1.10x). The four sums put the row's float32 sum in another order
   than the tile's (as the int8 / bfloat16 batch-1 tile's two sums do): a batch-1 row equals a batch-2 row to
   rounding, not bit for bit. */
static inline __attribute__((always_inline)) void f32_row(const float *x, const float *w, float *y,
                                                          const float *scale, const float *bias, int K, int n) {
  const float *wr = w + (size_t)n * K;
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int k = 0;
  for (; k + 4 * VW <= K; k += 4 * VW) {
    a0 = vfma(vload_f32(wr + k), vload_f32(x + k), a0);
    a1 = vfma(vload_f32(wr + k + VW), vload_f32(x + k + VW), a1);
    a2 = vfma(vload_f32(wr + k + 2 * VW), vload_f32(x + k + 2 * VW), a2);
    a3 = vfma(vload_f32(wr + k + 3 * VW), vload_f32(x + k + 3 * VW), a3);
  }
  for (; k + VW <= K; k += VW) a0 = vfma(vload_f32(wr + k), vload_f32(x + k), a0);
  float s = vsum((a0 + a1) + (a2 + a3));
  for (; k < K; k++) s += wr[k] * x[k];
  if (scale) s *= scale[n];
  if (bias) s += bias[n];
  y[n] = s;
}

#define KERNEL(NAME, WT, VLOAD, SLOAD, PF, WIDE_M)                                                               \
  TILE(NAME##_tile, WT, VLOAD, SLOAD, PF)                                                                        \
  TILE1(NAME##_tile1, WT, VLOAD, SLOAD)                                                                          \
  void NAME(const float *x, const WT *w, float *y, const float *scale, const float *bias, int M, int N, int K) { \
    int RB = M == 1 ? 4 : VW == 8 ? (M <= 2 ? 4 : 2) : (M <= 4 || !(WIDE_M) ? 4 : 2);                      \
    int MB = RB == 4 ? 4 : VW == 8 && M > 6 && M <= 8 ? 4 : 8;                                                 \
    int blocks = (N + RB - 1) / RB;                                                                            \
    int wide = (size_t)N * K * sizeof(WT) * (M < 4 ? 1 : 4) >= PARALLEL_BYTES;                                 \
    _Pragma("omp parallel for schedule(static) if(wide)") for (int b = 0; b < blocks; b++) {                  \
      int n = RB * b, R = N - n < RB ? N - n : RB;                                                             \
      if (M == 1 && R == 4 && VW > 1 && sizeof(WT) < 4) {                                                      \
        NAME##_tile1(x, w, y, scale, bias, K, n);                                                              \
        continue;                                                                                              \
      }                                                                                                        \
      if (M == 1 && sizeof(WT) == 4 && VW == 8) {                                                              \
        for (int r = 0; r < R; r++) f32_row(x, (const float *)w, y, scale, bias, K, n + r);                    \
        continue;                                                                                              \
      }                                                                                                        \
      for (int m0 = 0; m0 < M; m0 += MB) {                                                                     \
        int MT = M - m0 < MB ? M - m0 : MB;                                                                    \
        if (R == 4) {                                                                                          \
          TILE_CASES4(NAME, 4, n)                                                                              \
        } else if (R == 2) {                                                                                   \
          TILE_CASES8(NAME, 2, n)                                                                              \
        } else {                                                                                               \
          for (int r = 0; r < R; r++) TILE_CASES8(NAME, 1, n + r)                                              \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }

KERNEL(hc_linear_f32, float, vload_f32, sload_f32, PF_ROWS, 0)
KERNEL(hc_linear_bf16, uint16_t, vload_bf16, sload_bf16, PF_ROWS, 1)
KERNEL(hc_linear_i8, int8_t, vload_i8, sload_i8, PF_ROWS, 1)

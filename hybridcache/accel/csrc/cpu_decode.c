/* Small-batch linear layers for CPU decode: y[M, N] = x[M, K] @ w[N, K]^T (* scale[N]) (+ bias[N]).

   A decode step multiplies a few rows (M = the batch) by every weight matrix once, so its speed is the speed at
   which the weights stream from memory. BLAS gemv/gemm kernels for M = 1..16 reach only part of that (and need the
   weights in float32); this kernel reads each weight row once for all M rows of x, converts int8 / bfloat16
   weights to float32 in registers, and accumulates in float32. Rows of w are split over OpenMP threads (the
   runtime torch itself uses). Compiled on first use by hybridcache/accel/build.py (-march=native, -fopenmp where
   the compiler takes it: without it every kernel runs on one thread).

   Safety: no array here is sized or indexed by a caller's size (fixed-size arrays only, indexed below their constant
   bounds); scratch memory comes from malloc and a failed allocation is reported (hc_decode_attention returns
   nonzero), never written through. The Python wrappers (cpu_kernels.py) check every size, dtype, device and
   stride before a call; the kernels still tolerate zero sizes and a chunk / window <= 0 (nothing visible). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#define HC_OPENMP 1
#else /* a compiler without OpenMP (e.g. Apple clang): the pragmas are ignored, every kernel runs on one thread */
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#define HC_OPENMP 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_i8(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vload_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#define ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_i8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vload_bf16(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define ISA "avx2"
#else
#define VW 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload_f32(const float *p) { return *p; }
static inline vf vload_i8(const int8_t *p) { return (float)*p; }
static inline vf vload_bf16(const uint16_t *p) {
  union { uint32_t u; float f; } c = {(uint32_t)*p << 16};
  return c.f;
}
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf a) { return a; }
#define ISA "scalar"
#endif

const char *hc_isa(void) { return ISA; }
/* Whether this build runs on OpenMP threads, and how many a parallel region gets. */
int hc_openmp(void) { return HC_OPENMP; }
int hc_threads(void) { return omp_get_max_threads(); }

/* exp of each lane (Cephes' expf polynomial after x = n ln2 + r; within ~2 ulp of expf for results of at least
   2^-125). Special values as expf: NaN stays NaN (each clamp takes x as its second operand, which min / max return
   when it is NaN), above ln(FLT_MAX) +inf (+inf included), -inf 0 (AVX2 flushes results below 2^-125 to 0; expf
   would give denormals there). */
#define EXP_LO -87.3365478515625f   /* n = -126 */
#define EXP_OVER 88.72283935546875f /* just above ln(FLT_MAX): n = 128 */
#if VW == 16
static inline vf vexp(vf x0) {
  /* scalef scales by 2^n without overflow in between: the clamps only keep n finite (0 and +inf come out right) */
  vf x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x0));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
#elif VW == 8
static inline vf vexp(vf x0) {
  vf x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), _mm256_min_ps(_mm256_set1_ps(EXP_OVER), x0));
  vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  vf p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  /* (2p) * 2^(n-1), exactly p * 2^n: for n = 128 (x above ln(FLT_MAX)) the product overflows to +inf as expf does,
     where 2^n itself would not be a float; for n = -126 (the clamp floor, -inf included) 2^(n-1) has the exponent
     bits 0: the result is 0. NaN: p is NaN. */
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(_mm256_add_ps(p, p), _mm256_castsi256_ps(e));
}
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
#else
static inline vf vexp(vf x) { return expf(x); }
static inline vf vset1(float a) { return a; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline void vstore(float *p, vf a) { *p = a; }
#endif

/* Software prefetch, PF rows of w ahead (into L2): a tile reads R short rows at once, and the hardware prefetcher
   alone reaches about half the read bandwidth on int8 / bfloat16 rows (measured: int8 262k x 640 head 11.6 ->
   6.5 ms with it). The batch-1 tile prefetches linearly instead, PF_TILES tiles ahead (below). */
/* Below this many bytes of work (weights, x4 for 4+ rows of x) one thread does it: waking the others costs more. */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (256 * 1024)
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
#ifndef PF_TILES
#define PF_TILES 2
#endif

static inline float sload_f32(const float *p) { return *p; }
static inline float sload_i8(const int8_t *p) { return (float)*p; }
static inline float sload_bf16(const uint16_t *p) {
  union { uint32_t u; float f; } c = {(uint32_t)*p << 16};
  return c.f;
}

/* The sums of 16 vectors at once (a transpose-and-add tree: 30 shuffles and adds where 16 separate horizontal
   sums take about 130), lane i of the result = the sum of v[HSUM16_ORDER[i]]. */
#if VW == 16
static const int HSUM16_ORDER[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __attribute__((always_inline)) vf hsum16(const vf *v) {
  vf t[8], s[4], u[2];
  for (int i = 0; i < 8; i++) /* 256-bit halves: [v_i 8 partials | v_{i+8} 8 partials] */
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; i++) /* 128-bit lanes: 4 partials each of v_i, v_{i+8}, v_{i+4}, v_{i+12} */
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[i], t[i + 4], 0x88), _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD));
  for (int i = 0; i < 2; i++) /* per lane: 2 partials each of s_i, s_{i+2} */
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[i], s[i + 2]), _mm512_unpackhi_ps(s[i], s[i + 2]));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
}
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

#if VW == 16 /* several sums: one tree; a single one: the plain horizontal sum */
#define TILE_SUMS(acc, sums, COUNT)                                                                             \
  if ((COUNT) > 2) {                                                                                            \
    float tree_[16];                                                                                            \
    _mm512_storeu_ps(tree_, hsum16(acc));                                                                       \
    for (int i_ = 0; i_ < 16; i_++) sums[HSUM16_ORDER[i_]] = tree_[i_];                                         \
  } else {                                                                                                      \
    for (int i_ = 0; i_ < (COUNT); i_++) sums[i_] = vsum(acc[i_]);                                              \
  }
#else
#define TILE_SUMS(acc, sums, COUNT) \
  for (int i_ = 0; i_ < (COUNT); i_++) sums[i_] = vsum(acc[i_]);
#endif

/* Every (R, MT) combination as a constant, so the compiler keeps the tile's sums in registers: up to 4 rows of x,
   4 weight rows per tile; more rows of x, 2 weight rows and up to 8 rows of x per tile. avx2 has 16 vector
   registers, so 2 x 8 sums spill: 7-8 rows of x go as two passes of at most 4 (measured at batch 8 on a 2-core
   AMD EPYC, int8 / bfloat16 weights: 4096 x 640 5.2-6.3 -> 8.1 GB/s int8, 10.8-12.8 -> 15 bfloat16; the 262k x
   640 head about +15%); up to 6 rows fit in one pass, and 9-16 rows measured faster in passes of 8 than of 4. */
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

#define KERNEL(NAME, WT, VLOAD, SLOAD, PF, WIDE_M)                                                               \
  TILE(NAME##_tile, WT, VLOAD, SLOAD, PF)                                                                        \
  TILE1(NAME##_tile1, WT, VLOAD, SLOAD)                                                                          \
  void NAME(const float *x, const WT *w, float *y, const float *scale, const float *bias, int M, int N, int K) { \
    int RB = M <= 4 || !(WIDE_M) ? 4 : 2, MB = RB == 4 ? 4 : VW == 8 && M > 6 && M <= 8 ? 4 : 8;              \
    int blocks = (N + RB - 1) / RB;                                                                            \
    int wide = (size_t)N * K * sizeof(WT) * (M < 4 ? 1 : 4) >= PARALLEL_BYTES;                                 \
    _Pragma("omp parallel for schedule(static) if(wide)") for (int b = 0; b < blocks; b++) {                  \
      int n = RB * b, R = N - n < RB ? N - n : RB;                                                             \
      if (M == 1 && R == 4 && VW > 1 && sizeof(WT) < 4) {                                                      \
        NAME##_tile1(x, w, y, scale, bias, K, n);                                                              \
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

/* ---- the rest of a decode step's small work, where per-op dispatch costs more than the arithmetic ---------- */

static inline float sum_squares(const float *x, int D) {
  vf acc = vzero();
  int k = 0;
  for (; k + VW <= D; k += VW) {
    vf v = vload_f32(x + k);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (; k < D; k++) ss += x[k] * x[k];
  return ss;
}

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w over one row of D (every norm kernel here rounds this way). */
static inline void norm_row(const float *x, const float *w, float *y, int D, float eps) {
  float inv = 1.0f / sqrtf(sum_squares(x, D) / (float)D + eps);
  for (int k = 0; k < D; k++) y[k] = (x[k] * inv) * w[k];
}

/* y[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * w  (w: the norm's effective scale, e.g. 1 + weight). */
void hc_rms_norm(const float *x, const float *w, float *y, int rows, int D, float eps) {
  int wide = (size_t)rows * D >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (int r = 0; r < rows; r++) {
    norm_row(x + (size_t)r * D, w, y + (size_t)r * D, D, eps);
  }
}

/* h_out = h + (w_post ? rms_norm(x) * w_post : x), then n_out = rms_norm(h_out) * w_next (when w_next): the
   residual add between two norms (a sandwich-norm layer's post-norm and the next pre-norm) in one call. The norms
   round as hc_rms_norm does. */
void hc_residual_norm(const float *h, const float *x, const float *w_post, float eps_post, const float *w_next,
                      float eps_next, float *h_out, float *n_out, int rows, int D) {
  int wide = (size_t)rows * D >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (int r = 0; r < rows; r++) {
    const float *hr = h + (size_t)r * D, *xr = x + (size_t)r * D;
    float *ho = h_out + (size_t)r * D;
    if (w_post) {
      float inv = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps_post);
      for (int k = 0; k < D; k++) ho[k] = hr[k] + (xr[k] * inv) * w_post[k];
    } else {
      for (int k = 0; k < D; k++) ho[k] = hr[k] + xr[k];
    }
    if (w_next) norm_row(ho, w_next, n_out + (size_t)r * D, D, eps_next);
  }
}

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

/* argmax of x[s0, s1) as torch.argmax: the first index of the largest value, or of the first NaN if there is one.
   *nan_at: that NaN's index (-1: none); *best_v / *best_i: the first largest value and its index otherwise. */
static void argmax_range(const float *x, long s0, long s1, float *best_v, long *best_i, long *nan_at) {
  long i = s0, bi = s0;
  float bv = x[s0];
  *nan_at = -1;
#if VW == 16
  if (s1 - s0 >= 32) {
    __m512 vmax = _mm512_loadu_ps(x + s0);
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i vidx = lane, cur = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
    if (_mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q)) { i = s0; goto scalar; }
    for (i = s0 + 16; i + 16 <= s1; i += 16, cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16))) {
      __m512 v = _mm512_loadu_ps(x + i);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) goto scalar; /* the scalar loop finds the first NaN */
      __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ); /* strict: each lane keeps its first largest */
      vmax = _mm512_mask_blend_ps(gt, vmax, v);
      vidx = _mm512_mask_blend_epi32(gt, vidx, cur);
    }
    float mv[16];
    int mi[16];
    _mm512_storeu_ps(mv, vmax);
    _mm512_storeu_si512((void *)mi, vidx);
    bv = mv[0], bi = s0 + mi[0];
    for (int l = 1; l < 16; l++)
      if (mv[l] > bv || (mv[l] == bv && s0 + mi[l] < bi)) bv = mv[l], bi = s0 + mi[l];
    for (; i < s1; i++) {
      if (x[i] != x[i]) { *nan_at = i; return; }
      if (x[i] > bv) bv = x[i], bi = i;
    }
    *best_v = bv, *best_i = bi;
    return;
  }
scalar:
#endif
  for (; i < s1; i++) {
    if (x[i] != x[i]) { *nan_at = i; return; }
    if (x[i] > bv || i == s0) bv = x[i], bi = i;
  }
  *best_v = bv, *best_i = bi;
}

/* out[r] = argmax of row r of x [rows, n] (torch.argmax's answer, NaN included); a long row is split over threads. */
void hc_argmax_rows(const float *x, int64_t *out, int rows, long n) {
  int threads = omp_get_max_threads();
  int split = rows < threads && n >= (1 << 15) ? threads : 1;
  for (int r0 = 0; r0 < rows; r0 += (split > 1 ? 1 : rows)) {
    int r1 = split > 1 ? r0 + 1 : rows;
    float bv[64];
    long bi[64], nan_at[64];
    if (split > 64) split = 64;
    _Pragma("omp parallel for schedule(static) if(split > 1 || (long)rows * n >= (1 << 16))")
    for (int task = 0; task < (split > 1 ? split : r1 - r0); task++) {
      if (split > 1) {
        long chunk = (n + split - 1) / split, s0 = task * chunk < n ? task * chunk : n;
        long s1 = s0 + chunk < n ? s0 + chunk : n;
        if (s0 < s1) argmax_range(x + (size_t)r0 * n, s0, s1, &bv[task], &bi[task], &nan_at[task]);
        else nan_at[task] = -2; /* empty */
      } else {
        float v;
        long i, nn;
        argmax_range(x + (size_t)(r0 + task) * n, 0, n, &v, &i, &nn);
        out[r0 + task] = nn >= 0 ? nn : i;
      }
    }
    if (split > 1) {
      long best = -1;
      float v = 0.0f;
      for (int t = 0; t < split && best < 0; t++)
        if (nan_at[t] >= 0) best = nan_at[t];
      if (best < 0)
        for (int t = 0; t < split; t++)
          if (nan_at[t] == -1 && (best < 0 || bv[t] > v)) v = bv[t], best = bi[t];
      out[r0] = best;
    }
  }
}

static inline float dot_f32(const float *a, const float *b, int D) {
  vf acc = vzero();
  int k = 0;
  for (; k + VW <= D; k += VW) acc = vfma(vload_f32(a + k), vload_f32(b + k), acc);
  float s = vsum(acc);
  for (; k < D; k++) s += a[k] * b[k];
  return s;
}

/* Visibility of a key at position kp to a query at position qp (both real: >= 0), by pattern:
   0 full (kp <= qp), 1 sliding window W (qp - W < kp <= qp), 2 chunked C (same chunk, kp <= qp). A window or chunk
   <= 0 shows nothing (the wrapper refuses it first; no division by zero here either way). */
static inline int visible(long qp, long kp, int pattern, long param) {
  if (kp < 0 || kp > qp) return 0;
  if (pattern == 1) return param > 0 && kp > qp - param;
  if (pattern == 2) return param > 0 && kp / param == qp / param;
  return 1;
}

/* Per-thread scratch, grown as needed and kept (a decode step calls this once per layer: no malloc each time). */
static __thread float *scratch_f = NULL;
static __thread size_t scratch_n = 0;
static float *grow(float **buf, size_t *have, size_t n) { /* at least n floats in *buf (NULL: no memory) */
  if (n > *have) {
    free(*buf);
    *buf = (float *)malloc(sizeof(float) * n);
    *have = *buf ? n : 0;
  }
  return *buf;
}

static float *scratch(size_t n) { return grow(&scratch_f, &scratch_n, n); }

/* Keys and values are rows of D floats KV_AHEAD slots apart in the order attention reads them: their lines are
   prefetched that far ahead (the hardware prefetcher stops at each 4 KiB page, i.e. every few rows; the values are
   read in column blocks, so the first block's pass brings each whole row in for the others). Measured on a 2-core
   Xeon, Gemma 3 270M decode at 128-192 slots: the 18 layers' attention 0.49 -> 0.40 ms a step (16 ahead: no
   better). */
#ifndef KV_AHEAD
#define KV_AHEAD 8
#endif
static inline void prefetch_row(const float *row, int D) {
  for (int b = 0; b < D; b += 16) __builtin_prefetch(row + b, 0, 3);
}

/* The visible slots of [s0, s1) for one row's query (qp < 0: none) into idx, in order; returns their count. */
static int list_visible(int *idx, int s0, int s1, const uint8_t *mrow, const int64_t *kprow, long qp, int pattern,
                        long param) {
  int nv = 0;
  for (int s = s0; s < s1; s++)
    if (mrow ? mrow[s] : (qp >= 0 && visible(qp, kprow[s], pattern, param))) idx[nv++] = s;
  return nv;
}

/* Attention of the G query heads q [G, D] sharing one kv head over the nv slots idx (visible ones, in order):
   unnormalized output acc [G, D], per head the max score mx [G] (NaN scores ignored) and the sum of
   exp(score - mx) total [G]. Returns nv (0: acc, total 0 and mx -inf), or -1 when scratch memory could not be
   allocated. When every score of a head is -inf, the exponentials are taken against 0 (total 0: a weight of 0
   next to other ranges' finite scores); a NaN or +inf score makes total NaN, as softmax would. The numbers depend
   on the listed slots only: slots around them (hidden ones, or ones a cache evicted) change nothing. */
static int attend_list(const float *qh, const float *kb, const float *vb, long kss, long vss, const int *idx, int nv,
                       int D, int G, float scale, float softcap, float *acc, float *mx, float *total) {
  int n = nv;
  float *sc = scratch((size_t)n * G + 1); /* scores [G, n] */
  if (!sc) return -1;
  for (int g = 0; g < G; g++) {
    mx[g] = -INFINITY, total[g] = 0.0f;
    for (int d = 0; d < D; d++) acc[(size_t)g * D + d] = 0.0f;
  }
  if (nv == 0) return 0;
  int i0 = 0;
#if VW == 16
  /* 4 keys x up to 4 heads at a time: 16 dot products in registers, summed by one transpose-add tree */
  for (; i0 + 4 <= nv; i0 += 4) {
    const float *k0 = kb + idx[i0] * kss, *k1 = kb + idx[i0 + 1] * kss, *k2 = kb + idx[i0 + 2] * kss,
                *k3 = kb + idx[i0 + 3] * kss;
    for (int j = i0 + KV_AHEAD; j < i0 + KV_AHEAD + 4 && j < nv; j++) prefetch_row(kb + idx[j] * kss, D);
    for (int g0 = 0; g0 < G; g0 += 4) {
      int gn = G - g0 < 4 ? G - g0 : 4;
      vf a[16];
      for (int j = 0; j < 16; j++) a[j] = vzero();
      int d = 0;
      for (; d + VW <= D; d += VW) {
        vf x0 = vload_f32(k0 + d), x1 = vload_f32(k1 + d), x2 = vload_f32(k2 + d), x3 = vload_f32(k3 + d);
        for (int g = 0; g < 4; g++) {
          if (g >= gn) break;
          vf qv = vload_f32(qh + (size_t)(g0 + g) * D + d);
          a[4 * g] = vfma(qv, x0, a[4 * g]), a[4 * g + 1] = vfma(qv, x1, a[4 * g + 1]);
          a[4 * g + 2] = vfma(qv, x2, a[4 * g + 2]), a[4 * g + 3] = vfma(qv, x3, a[4 * g + 3]);
        }
      }
      float dots[16];
      TILE_SUMS(a, dots, 16);
      for (int g = 0; g < gn; g++) {
        const float *qg = qh + (size_t)(g0 + g) * D;
        for (int dd = d; dd < D; dd++) {
          dots[4 * g] += qg[dd] * k0[dd], dots[4 * g + 1] += qg[dd] * k1[dd];
          dots[4 * g + 2] += qg[dd] * k2[dd], dots[4 * g + 3] += qg[dd] * k3[dd];
        }
        for (int j = 0; j < 4; j++) {
          float x = dots[4 * g + j] * scale;
          if (softcap > 0) x = softcap * tanhf(x / softcap);
          sc[(size_t)(g0 + g) * n + i0 + j] = x;
          if (x > mx[g0 + g]) mx[g0 + g] = x;
        }
      }
    }
  }
#endif
  for (int i = i0; i < nv; i++) { /* each key read once for up to 8 heads at a time */
    const float *ks = kb + idx[i] * kss;
    for (int g0 = 0; g0 < G; g0 += 8) {
      int gn = G - g0 < 8 ? G - g0 : 8;
      float dots[8];
#if VW > 1
      vf a[8];
      for (int g = 0; g < gn; g++) a[g] = vzero();
      int d = 0;
      for (; d + VW <= D; d += VW) {
        vf kv = vload_f32(ks + d);
        for (int g = 0; g < gn; g++) a[g] = vfma(vload_f32(qh + (size_t)(g0 + g) * D + d), kv, a[g]);
      }
      for (int g = 0; g < gn; g++) {
        dots[g] = vsum(a[g]);
        for (int dd = d; dd < D; dd++) dots[g] += qh[(size_t)(g0 + g) * D + dd] * ks[dd];
      }
#else
      for (int g = 0; g < gn; g++) dots[g] = dot_f32(qh + (size_t)(g0 + g) * D, ks, D);
#endif
      for (int g = 0; g < gn; g++) {
        float x = dots[g] * scale;
        if (softcap > 0) x = softcap * tanhf(x / softcap);
        sc[(size_t)(g0 + g) * n + i] = x;
        if (x > mx[g0 + g]) mx[g0 + g] = x;
      }
    }
  }
  for (int g = 0; g < G; g++) {
    float *row = sc + (size_t)g * n, t = 0.0f, mg = mx[g] == -INFINITY ? 0.0f : mx[g];
    int i = 0;
#if VW > 1
    vf m = vset1(mg), tv = vzero();
    for (; i + VW <= nv; i += VW) {
      vf p = vexp(vload_f32(row + i) - m);
      vstore(row + i, p);
      tv = tv + p;
    }
    t = vsum(tv);
#endif
    for (; i < nv; i++) {
      row[i] = expf(row[i] - mg);
      t += row[i];
    }
    total[g] = t;
  }
  for (int i = 0; i < KV_AHEAD && i < nv; i++) prefetch_row(vb + idx[i] * vss, D);
  int d = 0;
#if VW > 1
  /* the weighted sum of values by blocks of 4 vectors of D and 4 heads: the 16 sums stay in registers over all
     visible slots (accumulating in memory made this loop store-bound) */
  for (; d + 4 * VW <= D; d += 4 * VW)
    for (int g0 = 0; g0 < G; g0 += 4) {
      int gn = G - g0 < 4 ? G - g0 : 4;
      vf a[4][4];
      for (int g = 0; g < 4; g++)
        for (int j = 0; j < 4; j++) a[g][j] = vzero();
      for (int i = 0; i < nv; i++) {
        const float *vs = vb + idx[i] * vss + d;
        if (d == 0 && g0 == 0 && i + KV_AHEAD < nv) prefetch_row(vb + idx[i + KV_AHEAD] * vss, D);
        vf v0 = vload_f32(vs), v1 = vload_f32(vs + VW), v2 = vload_f32(vs + 2 * VW), v3 = vload_f32(vs + 3 * VW);
        for (int g = 0; g < 4; g++) {
          if (g >= gn) break;
          vf w = vset1(sc[(size_t)(g0 + g) * n + i]);
          a[g][0] = vfma(w, v0, a[g][0]), a[g][1] = vfma(w, v1, a[g][1]);
          a[g][2] = vfma(w, v2, a[g][2]), a[g][3] = vfma(w, v3, a[g][3]);
        }
      }
      for (int g = 0; g < gn; g++)
        for (int j = 0; j < 4; j++) vstore(acc + (size_t)(g0 + g) * D + d + j * VW, a[g][j]);
    }
  for (; d + VW <= D; d += VW)
    for (int g = 0; g < G; g++) {
      vf a = vzero();
      for (int i = 0; i < nv; i++) a = vfma(vset1(sc[(size_t)g * n + i]), vload_f32(vb + idx[i] * vss + d), a);
      vstore(acc + (size_t)g * D + d, a);
    }
#endif
  for (; d < D; d++)
    for (int g = 0; g < G; g++) {
      float a = 0.0f;
      for (int i = 0; i < nv; i++) a += sc[(size_t)g * n + i] * vb[idx[i] * vss + d];
      acc[(size_t)g * D + d] = a;
    }
  return nv;
}

/* Per-thread list of visible slots (attend_range's; ints in a float buffer: the same size). */
static __thread float *index_f = NULL;
static __thread size_t index_n = 0;

/* attend_list over the visible slots of [s0, s1). */
static int attend_range(const float *qh, const float *kb, const float *vb, long kss, long vss, int s0, int s1, int D,
                        int G, const uint8_t *mrow, const int64_t *kprow, long qp, int pattern, long param,
                        float scale, float softcap, float *acc, float *mx, float *total) {
  int *idx = (int *)grow(&index_f, &index_n, (size_t)(s1 > s0 ? s1 - s0 : 0) + 1);
  if (!idx) return -1;
  int nv = list_visible(idx, s0, s1, mrow, kprow, qp, pattern, param);
  return attend_list(qh, kb, vb, kss, vss, idx, nv, D, G, scale, softcap, acc, mx, total);
}

/* The softmax-weighted sums of one (row, kv head) from `parts` ranges' attend_range results (range t: acc [G, D],
   mx [G], total [G] at part + t * stride, and its count of visible slots) into o [G, D]: each range rescaled to the
   common max. No visible slot anywhere: zeros. A NaN / +inf score anywhere, or only -inf scores: NaN, as softmax
   gives. For one range this is acc / total (w = 1). `sink` [G] (or NULL): a learned logit per query head that
   adds exp(sink - max) to the denominator only (GPT-OSS attention sinks; the max then counts the sink too, so a
   large sink cannot overflow the sum). */
static void combine_ranges(const float *part, const int *count, int parts, size_t stride, int G, int D,
                           const float *sink, float *o) {
  for (int g = 0; g < G; g++) {
    float m = -INFINITY, l = 0.0f, *og = o + (size_t)g * D;
    int seen = 0, nan = 0;
    for (int t = 0; t < parts; t++) {
      if (count[t] <= 0) continue;
      float mt = part[t * stride + (size_t)G * D + g], tot = part[t * stride + (size_t)G * D + G + g];
      seen = 1;
      if (tot != tot) nan = 1;
      else if (mt > m) m = mt;
    }
    for (int d = 0; d < D; d++) og[d] = 0.0f;
    if (!seen) continue;
    float sg = sink ? sink[g] : -INFINITY; /* the sink column counts like one more score */
    if (sg != sg) nan = 1;
    else if (sg > m) m = sg;
    if (nan || m == -INFINITY) {
      for (int d = 0; d < D; d++) og[d] = NAN;
      continue;
    }
    if (sink) l = expf(sg - m);
    for (int t = 0; t < parts; t++) {
      if (count[t] <= 0) continue;
      const float *p = part + t * stride;
      float mt = p[(size_t)G * D + g], w = mt == -INFINITY ? 0.0f : expf(mt - m);
      l += w * p[(size_t)G * D + G + g];
      for (int d = 0; d < D; d++) og[d] += w * p[(size_t)g * D + d];
    }
    for (int d = 0; d < D; d++) og[d] /= l;
  }
}

/* One query per row (a decode step), grouped-query attention over the visible slots only:
   q [B, Hq, D] (contiguous), k / v [B, Hkv, S, D] with strides (elements) sb, sh, ss for batch, head, slot and a
   contiguous last dim. Visibility: `mask` [B, S] (1 = visible) when given, else from the query positions qpos [B]
   and key positions kpos [B, S] by `pattern` / `param` (see visible()); a padding query (qpos < 0) sees nothing.
   out [B, Hq, D]. Hidden slots are never read (garbage in them cannot reach the output); a row that sees nothing
   gets zeros. softcap <= 0: none. `sinks` [Hq] (or NULL): a learned logit per query head in every softmax
   denominator, weighting no value (see combine_ranges). Each key and value is read once for the G query heads
   that share it. Work is split over threads by (row, kv head) when there are enough of those, else each pair's
   visible slots by ranges of equal count; either way the output depends on the visible slots only. Returns 0, or -1 when scratch memory could not be
   allocated (out is then incomplete). Hkv < 1 or Hq not a multiple of it: -2, nothing done. */
int hc_decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask, const int64_t *qpos,
                        const int64_t *kpos, int pattern, long param, float *out, int B, int Hq, int Hkv, int S,
                        int D, long ksb, long ksh, long kss, long vsb, long vsh, long vss, float scale,
                        float softcap, const float *sinks) {
  if (Hkv < 1 || Hq < 0 || Hq % Hkv || B < 0 || S < 0 || D < 0) return -2;
  int G = Hq / Hkv, pairs = B * Hkv, failed = 0;
  int threads = omp_get_max_threads();
  size_t stride = (size_t)G * (D + 2);
  if (pairs < threads) {
    /* fewer (row, kv head) pairs than threads: each pair's visible slots, listed once, split into one range per
       thread when there are enough of them (threads pay off above ~64k multiply-adds; below, waking one costs
       more), whose partial softmax sums are then combined (as flash-decoding does). Split by the count of visible
       slots, so the numbers depend on those slots only: a cache that holds hidden slots around them (evicted
       later, or reserved ahead by a multi-step decode) gives the same output. */
    int *vis = (int *)malloc(sizeof(int) * (size_t)S + 1);
    float *part = (float *)malloc(sizeof(float) * (size_t)threads * stride + 1);
    int *count = (int *)malloc(sizeof(int) * (size_t)threads);
    if (!vis || !part || !count) {
      free(vis), free(part), free(count);
      return -1;
    }
    for (int bk = 0; bk < pairs && !failed; bk++) {
      int b = bk / Hkv, kvh = bk % Hkv;
      const float *qh = q + ((size_t)b * Hq + (size_t)kvh * G) * D, *kb = k + b * ksb + kvh * ksh,
                  *vb = v + b * vsb + kvh * vsh;
      const float *sink = sinks ? sinks + (size_t)kvh * G : NULL;
      float *o = out + ((size_t)b * Hq + (size_t)kvh * G) * D;
      int nv = list_visible(vis, 0, S, mask ? mask + (size_t)b * S : NULL, kpos ? kpos + (size_t)b * S : NULL,
                            qpos ? qpos[b] : 0, pattern, param);
      int split = (size_t)nv * G * D >= (1 << 16) ? threads : 1, chunk = (nv + split - 1) / split;
      _Pragma("omp parallel num_threads(split) if(split > 1)") {
        for (int t = omp_get_thread_num(); t < split; t += omp_get_num_threads()) {
          int i0 = t * chunk < nv ? t * chunk : nv, i1 = i0 + chunk < nv ? i0 + chunk : nv;
          float *p = part + (size_t)t * stride;
          count[t] = attend_list(qh, kb, vb, kss, vss, vis + i0, i1 - i0, D, G, scale, softcap, p,
                                 p + (size_t)G * D, p + (size_t)G * D + G);
          if (count[t] < 0) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
      }
      if (!failed) combine_ranges(part, count, split, stride, G, D, sink, o);
    }
    free(vis), free(part), free(count);
    return failed ? -1 : 0;
  }
  /* a pair per thread at least: each pair's visible slots in one range */
  int wide = (size_t)pairs * S * G * D >= (1 << 16);
  _Pragma("omp parallel if(wide)") {
    float *a = (float *)malloc(sizeof(float) * stride + 1);
    if (!a) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    _Pragma("omp for schedule(static)") for (int bk = 0; bk < pairs; bk++) {
      if (!a) continue;
      int b = bk / Hkv, kvh = bk % Hkv;
      int nv = attend_range(q + ((size_t)b * Hq + (size_t)kvh * G) * D, k + b * ksb + kvh * ksh,
                            v + b * vsb + kvh * vsh, kss, vss, 0, S, D, G, mask ? mask + (size_t)b * S : NULL,
                            kpos ? kpos + (size_t)b * S : NULL, qpos ? qpos[b] : 0, pattern, param, scale, softcap,
                            a, a + (size_t)G * D, a + (size_t)G * D + G);
      if (nv < 0) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      else combine_ranges(a, &nv, 1, stride, G, D, sinks ? sinks + (size_t)kvh * G : NULL,
                          out + ((size_t)b * Hq + (size_t)kvh * G) * D);
    }
    free(a);
  }
  return failed ? -1 : 0;
}

/* Rotary rotation of the first 2 * h2 features of x into o (o may be x): half-split pairs (i, i + h2) or
   interleaved pairs (2i, 2i + 1), by cos / sin [2 * h2]. Each pair is read before it is written. */
static inline void rotate(const float *x, float *o, const float *c, const float *sn, int h2, int interleaved) {
  if (interleaved) {
    for (int i = 0; i < h2; i++) {
      float a = x[2 * i], bb = x[2 * i + 1];
      o[2 * i] = a * c[2 * i] - bb * sn[2 * i];
      o[2 * i + 1] = bb * c[2 * i + 1] + a * sn[2 * i + 1];
    }
  } else {
    for (int i = 0; i < h2; i++) {
      float a = x[i], bb = x[i + h2];
      o[i] = a * c[i] - bb * sn[i];
      o[i + h2] = bb * c[i + h2] + a * sn[i + h2];
    }
  }
}

/* Rotary embedding of x [B, H, T, D] (strides sb, sh, st in elements; contiguous last dim) into out [B, H, T, D]
   (contiguous): the first `rot` features rotated by cos / sin [B, T, rot], half-split pairs (i, i + rot/2) or
   interleaved pairs (2i, 2i + 1); features past `rot` are copied. */
void hc_rope(const float *x, long sb, long sh, long st, const float *cos_t, const float *sin_t, float *out, int B,
             int H, int T, int D, int rot, int interleaved) {
  int wide = (size_t)B * H * T * D >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long r = 0; r < (long)B * H * T; r++) {
    long b = r / ((long)H * T), h = (r / T) % H, t = r % T;
    const float *xr = x + b * sb + h * sh + t * st;
    float *o = out + (size_t)r * D;
    rotate(xr, o, cos_t + ((size_t)b * T + t) * rot, sin_t + ((size_t)b * T + t) * rot, rot / 2, interleaved);
    for (int i = rot; i < D; i++) o[i] = xr[i];
  }
}

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Mamba1 selective scan over T >= 1 tokens, state in and out (float32):
     dt = softplus(delta + bias) (or delta + bias), h = exp(dt A) h + dt u B_t, y = <h, C_t> + D u, y *= z
   (z: the gate silu(z), computed by the caller; the caller may also pass dt itself with bias NULL, softplus 0).
   u, delta, z: [B, T, Dm] (element strides ub/ut, db/dt_, zb/zt; contiguous over Dm); Bm, Cm: [B, T, N] (strides bb/bt,
   cb/ct; contiguous over N); A [Dm, N], D, bias [Dm] (D, bias, z may be NULL); state [B, Dm, N] (NULL: zeros);
   y out [B, T, Dm], state_out [B, Dm, N] (not overlapping state). Work is split over (row, channel). */
void hc_selective_scan(const float *u, long ub, long ut, const float *delta, long db, long dt_, const float *z, long zb,
                       long zt, const float *Bm, long bb, long bt, const float *Cm, long cb, long ct, const float *A,
                       const float *D, const float *bias, int softplus, const float *state, float *y,
                       float *state_out, int B, int T, int Dm, int N) {
  int wide = (size_t)B * T * Dm * N >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long bd = 0; bd < (long)B * Dm; bd++) {
    long b = bd / Dm, d = bd % Dm;
    float *h = state_out + (size_t)bd * N; /* the state is carried in the output itself: no scratch of N floats */
    for (int n = 0; n < N; n++) h[n] = state ? state[(size_t)bd * N + n] : 0.0f;
    const float *Ad = A + (size_t)d * N;
    for (int t = 0; t < T; t++) {
      float dl = delta[b * db + t * dt_ + d] + (bias ? bias[d] : 0.0f);
      if (softplus) dl = softplusf(dl);
      float ud = u[b * ub + t * ut + d], du = dl * ud;
      const float *Bt = Bm + b * bb + t * bt, *Ct = Cm + b * cb + t * ct;
      float acc_s = 0.0f;
      int n = 0;
#if VW > 1
      vf accv = vzero();
      for (; n + VW <= N; n += VW) {
        vf hv = vload_f32(h + n);
        hv = vfma(vexp(vmul(vset1(dl), vload_f32(Ad + n))), hv, vmul(vset1(du), vload_f32(Bt + n)));
        vstore(h + n, hv);
        accv = vfma(hv, vload_f32(Ct + n), accv);
      }
      acc_s = vsum(accv);
#endif
      for (; n < N; n++) {
        h[n] = expf(dl * Ad[n]) * h[n] + du * Bt[n];
        acc_s += h[n] * Ct[n];
      }
      float out = acc_s + (D ? D[d] * ud : 0.0f);
      if (z) out *= z[b * zb + t * zt + d]; /* the gate, silu(z), computed by the caller (vectorized) */
      y[((size_t)b * T + t) * Dm + d] = out;
    }
  }
}

/* RMSNorm (optional) then rotary embedding (optional) of x [B, H, T, D] (strides sb, sh, st in elements, contiguous
   last dim) into out [B, H, T, D] (contiguous): per row y = x * (1 / sqrt(mean(x^2) + eps)) * scale (scale NULL: no
   norm), then the first `rot` features rotated by cos / sin [B, T, rot] (rot 0: none) as in hc_rope. One call for
   what a layer's q or k needs before attention. */
void hc_norm_rope(const float *x, long sb, long sh, long st, const float *scale, float eps, const float *cos_t,
                  const float *sin_t, float *out, int B, int H, int T, int D, int rot, int interleaved) {
  int wide = (size_t)B * H * T * D >= PARALLEL_BYTES / 4;
  _Pragma("omp parallel for schedule(static) if(wide)") for (long r = 0; r < (long)B * H * T; r++) {
    long b = r / ((long)H * T), h = (r / T) % H, t = r % T;
    const float *xr = x + b * sb + h * sh + t * st;
    float *o = out + (size_t)r * D;
    if (scale) {
      norm_row(xr, scale, o, D, eps);
    } else {
      for (int k = 0; k < D; k++) o[k] = xr[k];
    }
    if (rot) rotate(o, o, cos_t + ((size_t)b * T + t) * rot, sin_t + ((size_t)b * T + t) * rot, rot / 2, interleaved);
  }
}

/* ---- a decoder layer's branches in one call each: no interpreter between their kernels ---------------------- */

/* weight type codes: 0 float32, 1 bfloat16, 2 int8 (+ per-row scale) */
static void linear_any(int wtype, const float *x, const void *w, float *y, const float *scale, const float *bias,
                       int M, int N, int K) {
  if (wtype == 1) hc_linear_bf16(x, (const uint16_t *)w, y, scale, bias, M, N, K);
  else if (wtype == 2) hc_linear_i8(x, (const int8_t *)w, y, scale, bias, M, N, K);
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

/* ---- a decode step's attention / decoder layer in one call, and many layers in one call --------------------
   The parameters of hc_attention_step (HC_STEP_FIELDS) and hc_decoder_layer (those, then HC_TAIL_FIELDS), listed
   once (X: a parameter's C type, name and ctypes code). hc_decoder_stack takes hc_decoder_layer's arguments as a
   record, one per layer, and runs the records in order: no interpreter between layers, whose Python ran with the
   caches cold after each layer's weights (measured on a 2-core Xeon, Gemma 3 270M with int8 weights: the layers'
   Python 4.4 -> 1.9 ms a step, the step 16.8 -> ~13.7 ms). The record's type codes let the loader check it against
   the op's declared signature (op_specs.py) before any call. */
#define HC_STEP_FIELDS(X, SEP)                                                                                     \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(const void *, w, P) SEP()                 \
  X(int, wtype, I) SEP() X(const float *, wscale, P) SEP() X(const float *, bias, P) SEP() X(int, Hq, I) SEP()     \
  X(int, Hkv, I) SEP() X(int, D, I) SEP() X(float *, qkv, P) SEP() X(const float *, q_scale, P) SEP()               \
  X(float, q_eps, F) SEP() X(const float *, k_scale, P) SEP() X(float, k_eps, F) SEP()                             \
  X(const float *, cos_t, P) SEP() X(const float *, sin_t, P) SEP() X(int, rot, I) SEP() X(int, interleaved, I)     \
  SEP() X(float *, q_out, P) SEP() X(float *, k_new, P) SEP() X(const float *, in_scale, P) SEP()                   \
  X(float, in_eps, F) SEP() X(float *, xn, P) SEP() X(float *, keys, P) SEP() X(float *, values, P) SEP()           \
  X(long, slot, L) SEP() X(int, S, I) SEP() X(long, ksb, L) SEP() X(long, ksh, L) SEP() X(long, kss, L) SEP()      \
  X(long, vsb, L) SEP() X(long, vsh, L) SEP() X(long, vss, L) SEP() X(const int64_t *, qpos, P) SEP()              \
  X(const int64_t *, kpos, P) SEP() X(int, pattern, I) SEP() X(long, param, L) SEP() X(float, scale, F) SEP()      \
  X(float, softcap, F) SEP() X(const float *, sinks, P) SEP() X(float *, a, P)
#define HC_TAIL_FIELDS(X, SEP)                                                                                     \
  X(const void *, w_o, P) SEP() X(int, o_type, I) SEP() X(const float *, o_scale, P) SEP()                         \
  X(const float *, o_bias, P) SEP() X(const float *, post_attn, P) SEP() X(float, post_attn_eps, F) SEP()          \
  X(const float *, pre_mlp, P) SEP() X(float, pre_mlp_eps, F) SEP() X(int, I, I) SEP() X(const void *, w_gu, P)    \
  SEP() X(int, gu_type, I) SEP() X(const float *, gu_scale, P) SEP() X(const float *, gu_bias, P) SEP()            \
  X(const void *, w_dn, P) SEP() X(int, dn_type, I) SEP() X(const float *, dn_scale, P) SEP()                      \
  X(const float *, dn_bias, P) SEP() X(int, act, I) SEP() X(const float *, post_mlp, P) SEP()                      \
  X(float, post_mlp_eps, F) SEP() X(float *, tail_scratch, P) SEP() X(float *, y, P)
#define HC_LAYER_RECORD(X, SEP) HC_STEP_FIELDS(X, SEP) SEP() HC_TAIL_FIELDS(X, SEP)
#define HC_REC_FIELD(T, N, C) T N
#define HC_REC_ARG(T, N, C) r->N
#define HC_REC_NAME(T, N, C) N
#define HC_REC_CODE(T, N, C) #C
#define HC_REC_NAME_STR(T, N, C) #N
#define HC_REC_NAME_SEP() ","
#define HC_REC_SEMI() ;
#define HC_REC_COMMA() ,
#define HC_REC_NONE()
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

typedef struct {
  HC_LAYER_RECORD(HC_REC_FIELD, HC_REC_SEMI);
} hc_layer_record;

const char *hc_layer_record_codes(void) { return HC_LAYER_RECORD(HC_REC_CODE, HC_REC_NONE); }
int hc_layer_record_size(void) { return (int)sizeof(hc_layer_record); }
const char *hc_layer_record_names(void) { return HC_LAYER_RECORD(HC_REC_NAME_STR, HC_REC_NAME_SEP); }

/* The n records in order (each one's x the previous one's y: the caller sets the pointers). Returns 0, or the
   first failing layer's hc_decoder_layer code with its index in *failed (the layers before it ran). */
int hc_decoder_stack(const hc_layer_record *layers, int n, int *failed) {
  for (int i = 0; i < n; i++) {
    const hc_layer_record *r = layers + i;
    int err = hc_decoder_layer(HC_LAYER_RECORD(HC_REC_ARG, HC_REC_COMMA));
    if (err) {
      *failed = i;
      return err;
    }
  }
  return 0;
}

/* Greedy decode steps of one row in one call (blocks/fast/decode_run.py): no interpreter between steps. From token
   `first`, step j embeds its token (row of `embed` [vocab, Dm] of embed_type, widened, times its row scale
   embed_rs [vocab] when given, times embed_scale: as the model's embedding) into x [Dm], runs the n layer records (hc_decoder_stack's, as built for the run's first step: step j moves each one's
   slot and slot count on by j, its query position to qpos[j] and its rotary tables to row j of [steps, rot]
   tables cos_tabs / sin_tabs[rope[i]] (rope[i] < 0: none); layer 0 reads x), the final RMSNorm (norm_w [Dm],
   NULL: none) into normed [Dm], the head (w_head [V, Dm] of head_type, head_scale / head_bias or NULL) into a row
   of logits, and takes its first largest value as the next token (hc_argmax_rows, as greedy decoding does).
   tokens [steps] gets the tokens, logits [steps, V] each step's logits (keep = 0: every step reuses row 0). Stops
   after `steps` tokens or after a token in eos [n_eos]. Returns the count of tokens; on failure -1 (a layer found
   no memory for its attention's scratch), -2 (a token outside the embedding: nothing run for it) or -3 (the step's
   chosen logit is not finite: its row holds a NaN or +inf, or is -inf everywhere), with the count of tokens before
   it in *done. The caller checked every size and pointer (the records as hc_decoder_stack's;
   the tables, positions and buffers for `steps`). */
int hc_decode_steps(const hc_layer_record *layers, int n, int from, const int *rope, const float *const *cos_tabs,
                    const float *const *sin_tabs, const int64_t *qpos, int steps, const void *embed, int embed_type,
                    const float *embed_rs, long vocab, float embed_scale, const float *norm_w, float norm_eps, const void *w_head, int head_type,
                    const float *head_scale, const float *head_bias, int V, float *x, float *normed, float *logits,
                    int keep, const int64_t *eos, int n_eos, int64_t first, int64_t *tokens, int *done) {
  *done = 0;
  if (n < 1 || steps < 1) return 0;
  int Dm = layers[0].Dm;
  const float *last = layers[n - 1].y;
  int64_t tok = first;
  for (int j = 0; j < steps; j++) {
    if (tok < 0 || tok >= vocab) return -2;
    size_t at = (size_t)tok * Dm;
    if (embed_type == 2) { /* int8 rows widened, times their scale, then the multiplier (two roundings, as torch) */
      const int8_t *row = (const int8_t *)embed + at;
      float rs = embed_rs ? embed_rs[tok] : 1.0f;
      for (int d = 0; d < Dm; d++) x[d] = embed_rs ? ((float)row[d] * rs) * embed_scale : (float)row[d] * embed_scale;
    } else if (embed_type == 1) { /* bfloat16 rows widened (exact) */
      const uint16_t *row = (const uint16_t *)embed + at;
      for (int d = 0; d < Dm; d++) {
        union { uint32_t u; float f; } w = {(uint32_t)row[d] << 16};
        x[d] = w.f * embed_scale;
      }
    } else {
      const float *row = (const float *)embed + at;
      for (int d = 0; d < Dm; d++) x[d] = row[d] * embed_scale;
    }
    for (int i = 0; i < n; i++) {
      hc_layer_record rec = layers[i], *r = &rec;
      if (i == 0) rec.x = x;
      rec.slot += from + j, rec.S += from + j, rec.qpos = qpos + j;
      if (rope[i] >= 0) {
        rec.cos_t = cos_tabs[rope[i]] + (size_t)j * rec.rot;
        rec.sin_t = sin_tabs[rope[i]] + (size_t)j * rec.rot;
      }
      if (hc_decoder_layer(HC_LAYER_RECORD(HC_REC_ARG, HC_REC_COMMA))) return -1;
    }
    float *out = logits + (keep ? (size_t)j * V : 0);
    const float *h = last;
    if (norm_w) {
      hc_rms_norm(last, norm_w, normed, 1, Dm, norm_eps);
      h = normed;
    }
    linear_any(head_type, h, w_head, out, head_scale, head_bias, 1, V, Dm);
    hc_argmax_rows(out, &tok, 1, V);
    if (!isfinite(out[tok])) return -3; /* a NaN (argmax takes the first), +inf, or -inf everywhere: no next token */
    tokens[j] = tok;
    *done = j + 1;
    for (int e = 0; e < n_eos; e++)
      if (eos[e] == tok) return j + 1;
  }
  return steps;
}

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

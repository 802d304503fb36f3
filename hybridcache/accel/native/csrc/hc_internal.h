/* What every op-family file of the decode kernels shares: the headers, the OpenMP stand-ins, the ISA layer (one
   vector type `vf` of VW floats and its operations as static inline functions: avx512, avx2 + fma or scalar, chosen
   by what -march=native enables), scalar loads of each weight type, the horizontal sums, the size below which a
   kernel runs on one thread, and the per-thread scratch helper. Part of the one translation unit cpu_decode.c. */
#ifndef HC_INTERNAL_H
#define HC_INTERNAL_H

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

/* Below this many bytes of work (weights, x4 for 4+ rows of x) one thread does it: waking the others costs more. */
#ifndef PARALLEL_BYTES
#define PARALLEL_BYTES (256 * 1024)
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

/* The horizontal sums of acc[0 .. COUNT) into sums[] (a GEMV tile's, attention's 4 keys x 4 heads). */
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

/* Per-thread scratch, grown as needed and kept (a kernel called once per layer does not malloc each time). */
static float *grow(float **buf, size_t *have, size_t n) { /* at least n floats in *buf (NULL: no memory) */
  if (n > *have) {
    free(*buf);
    *buf = (float *)malloc(sizeof(float) * n);
    *have = *buf ? n : 0;
  }
  return *buf;
}

#endif /* HC_INTERNAL_H */

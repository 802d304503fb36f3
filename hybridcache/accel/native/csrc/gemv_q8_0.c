/* Linear layers with q8_0 weights (llama.cpp's block layout): y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) where each
   block of 32 weights along K is int8 times its own float16 scale, hc_linear_q8_0.

   The activations are quantized the same way at run time (per row, per block of 32: d = max|x| / 127, q =
   round-to-nearest-even(x * (1 / d)), d kept in float32), so each block's dot product is a sum of 32 int8 x int8
   products, exact in int32; the float work is one multiply-add per block: y += (d_w * d_x) * isum. On avx2 the 32
   products take 3 integer ops (`_mm256_maddubs_epi16` on |x| and w with x's sign, `_mm256_madd_epi16` to int32) where
   widening int8 weights to float costs 2 ops per 8 weights before the float multiply-add (hc_linear_i8); with
   avx512-vnni / avx-vnni one `vpdpbusd`. The same integers either way (|w|, |x| <= 127: the int16 pairs never
   saturate), so every build computes the same block sums; only the float summation order differs from the torch
   recompute (hybridcache/ops/q8_0.py). Rows of w are split over OpenMP threads in tiles of 4. */

#define Q8_BLOCK 32
#ifndef Q8_PREFETCH /* -DQ8_PREFETCH=0: no software prefetch (for measuring) */
#define Q8_PREFETCH 1
#endif
#ifndef Q8_PF_TILES
#define Q8_PF_TILES 4
#endif

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else /* IEEE binary16 -> binary32, subnormals, inf and NaN included */
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  union { uint32_t u; float f; } c;
  if (exp == 0x1F) c.u = sign | 0x7F800000u | (man << 13);
  else if (exp) c.u = sign | ((exp + 112) << 23) | (man << 13);
  else { /* zero or subnormal: man * 2^-24 */
    c.f = (float)man * 5.9604644775390625e-8f;
    c.u |= sign;
  }
  return c.f;
#endif
}

/* One row x [K] -> q [K] int8 and d [K / 32] float32 (K a multiple of 32): the same arithmetic as the torch
   recompute (amax / 127 in float32, its reciprocal, x * reciprocal rounded to nearest even). */
static void q8_quantize_row(const float *x, int8_t *q, float *d, int K) {
  for (int b = 0; b < K / Q8_BLOCK; b++) {
    const float *xb = x + (size_t)b * Q8_BLOCK;
    float amax = 0.0f;
    for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    d[b] = db;
    for (int i = 0; i < Q8_BLOCK; i++) q[(size_t)b * Q8_BLOCK + i] = (int8_t)nearbyintf(xb[i] * id);
  }
}

/* The products of one weight block and one activation block as 8 int32 partial sums (their total is the block's
   exact int32 sum). */
#if defined(__AVX2__)
#define Q8_SIMD 1
static inline __m256i q8_block_dot(const int8_t *w, const int8_t *x, __m256i ax) {
  /* |x| (unsigned, computed once per block for all rows) times w with x's sign */
  __m256i sw = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w), _mm256_loadu_si256((const __m256i *)x));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
}
static inline __m256i q8_abs_block(const int8_t *x) {
  __m256i xv = _mm256_loadu_si256((const __m256i *)x);
  return _mm256_sign_epi8(xv, xv);
}
/* The exact int32 sums of 4 consecutive blocks (w and x 32 apart), lane i = block i: two rounds of hadd and one add
   of the halves, where a float multiply-add per block cost more than the products themselves (measured: the L2
   compute ceiling 20.6 -> see docs/benchmarks.md). */
static inline __m128i q8_dot4(const int8_t *w, const int8_t *x, const __m256i *ax) {
  __m256i h01 = _mm256_hadd_epi32(q8_block_dot(w, x, ax[0]), q8_block_dot(w + 32, x + 32, ax[1]));
  __m256i h23 = _mm256_hadd_epi32(q8_block_dot(w + 64, x + 64, ax[2]), q8_block_dot(w + 96, x + 96, ax[3]));
  __m256i h = _mm256_hadd_epi32(h01, h23); /* [b0 b1 b2 b3 | b0 b1 b2 b3], each half its lanes' part */
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
static inline int32_t q8_hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
static inline __m128 q8_scales4(const uint16_t *s) { /* 4 float16 scales -> float32 */
#if defined(__F16C__)
  return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)s));
#else
  return _mm_setr_ps(half_to_float(s[0]), half_to_float(s[1]), half_to_float(s[2]), half_to_float(s[3]));
#endif
}
static inline float q8_hsum_ps(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define Q8_SIMD 0
#endif
static inline int32_t q8_block_dot_scalar(const int8_t *w, const int8_t *x) {
  int32_t s = 0;
  for (int i = 0; i < Q8_BLOCK; i++) s += (int32_t)w[i] * (int32_t)x[i];
  return s;
}

/* R (<= 4) rows of w from n against one quantized row of x (xq [K], xd [K / 32]): y[n .. n + R). Each block adds
   (d_w * d_x) * isum in float32: 4 blocks at a time as one 4-lane multiply-add, the last K / 32 % 4 one by one. */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *xq, const float *xd, const int8_t *w,
                                                          const uint16_t *scale, const float *bias, float *y, int R,
                                                          int n, int K, int prefetch) {
  int G = K / Q8_BLOCK;
  const int8_t *w0 = w + (size_t)n * K;
  const uint16_t *s0 = scale + (size_t)n * G;
#if Q8_SIMD
  __m128 acc[4];
  for (int r = 0; r < 4; r++) acc[r] = _mm_setzero_ps();
  /* a thread's tiles are consecutive rows: prefetch Q8_PF_TILES tiles ahead in order (as gemv.c's batch-1 tile),
     one line per 64 bytes of each row (measured on the 2-core AMD EPYC, one thread, the 262144 x 640 head, ABBA:
     without it 0.31x; 4 tiles ahead 1.10x of 2, 8 no better than 4) */
  const uintptr_t ahead = (uintptr_t)w0 + (uintptr_t)Q8_PF_TILES * 4 * (size_t)K;
  int b = 0;
  for (; b + 4 <= G; b += 4) {
    if (Q8_PREFETCH && prefetch)
      for (int r = 0; r < R; r++)
        for (int c = 0; c < 4 * Q8_BLOCK; c += 64)
          __builtin_prefetch((const void *)(ahead + (size_t)r * K + (size_t)b * Q8_BLOCK + c), 0, PF_LOCALITY);
    const int8_t *xb = xq + (size_t)b * Q8_BLOCK;
    __m128 dx = _mm_loadu_ps(xd + b);
    __m256i ax[4];
    for (int j = 0; j < 4; j++) ax[j] = q8_abs_block(xb + j * Q8_BLOCK);
    for (int r = 0; r < R; r++) {
      __m128 p = _mm_cvtepi32_ps(q8_dot4(w0 + (size_t)r * K + (size_t)b * Q8_BLOCK, xb, ax));
      acc[r] = _mm_fmadd_ps(p, _mm_mul_ps(q8_scales4(s0 + (size_t)r * G + b), dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float s = q8_hsum_ps(acc[r]);
    for (int bb = b; bb < G; bb++) {
      const int8_t *xb = xq + (size_t)bb * Q8_BLOCK;
      int32_t isum = q8_hsum_i32(q8_block_dot(w0 + (size_t)r * K + (size_t)bb * Q8_BLOCK, xb, q8_abs_block(xb)));
      s += (float)isum * (half_to_float(s0[(size_t)r * G + bb]) * xd[bb]);
    }
    y[n + r] = bias ? s + bias[n + r] : s;
  }
#else
  (void)prefetch;
  for (int r = 0; r < R; r++) {
    float s = 0.0f;
    for (int b = 0; b < G; b++)
      s += (float)q8_block_dot_scalar(w0 + (size_t)r * K + (size_t)b * Q8_BLOCK, xq + (size_t)b * Q8_BLOCK) *
           (half_to_float(s0[(size_t)r * G + b]) * xd[b]);
    y[n + r] = bias ? s + bias[n + r] : s;
  }
#endif
}

/* The quantized activations, per calling thread (the OpenMP threads read the caller's): M rows of K int8, then M rows
   of K / 32 float32 scales. */
static __thread float *q8_x_f = NULL;
static __thread size_t q8_x_n = 0;

/* Without scratch memory (malloc failed): each block of x quantized where it is used, one thread, the same block
   sums (slow, never wrong). */
static void q8_linear_unbuffered(const float *x, const int8_t *w, float *y, const uint16_t *scale, const float *bias,
                                 int M, int N, int K) {
  int G = K / Q8_BLOCK;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float s = 0.0f;
      for (int b = 0; b < G; b++) {
        int8_t q[Q8_BLOCK];
        float d;
        q8_quantize_row(x + (size_t)m * K + (size_t)b * Q8_BLOCK, q, &d, Q8_BLOCK);
        s += (float)q8_block_dot_scalar(w + (size_t)n * K + (size_t)b * Q8_BLOCK, q) *
             (half_to_float(scale[(size_t)n * G + b]) * d);
      }
      y[(size_t)m * N + n] = bias ? s + bias[n] : s;
    }
}

#if VW == 8
#ifndef Q8_GEMM_MIN_ROWS
#define Q8_GEMM_MIN_ROWS 17 /* a decode step's 1-16 rows keep the integer kernel; a prefill runs q8_gemm */
#endif
static int q8_gemm(const int8_t *xq, const float *xd, const int8_t *w, const uint16_t *scale, const float *bias,
                   float *y, int M, int N, int K); /* gemm.c */
#endif

/* y [M, N] = x [M, K] @ (w [N, K] int8 x scale [N, K / 32] float16 per block)^T (+ bias [N]); K a multiple of 32
   (the wrappers check). */
void hc_linear_q8_0(const float *x, const int8_t *w, float *y, const uint16_t *scale, const float *bias, int M, int N,
                    int K) {
  if (M < 1 || N < 1) return;
  size_t G = (size_t)K / Q8_BLOCK, qfloats = ((size_t)M * K + 3) / 4;
  float *buf = grow(&q8_x_f, &q8_x_n, qfloats + (size_t)M * G + 1);
  if (!buf) {
    q8_linear_unbuffered(x, w, y, scale, bias, M, N, K);
    return;
  }
  int8_t *xq = (int8_t *)buf;
  float *xd = buf + qfloats;
  for (int m = 0; m < M; m++) q8_quantize_row(x + (size_t)m * K, xq + (size_t)m * K, xd + (size_t)m * G, K);
#if VW == 8
  if (M >= Q8_GEMM_MIN_ROWS && q8_gemm(xq, xd, w, scale, bias, y, M, N, K) == 0) return;
#endif
  int blocks = (N + 3) / 4;
  int wide = (size_t)N * K >= PARALLEL_BYTES;
  /* each tile's 4 weight rows are read from memory once, for the first row of x; the other rows of x find them in
     L1 / L2 */
#pragma omp parallel for schedule(static) if (wide)
  for (int t = 0; t < blocks; t++) {
    int n = 4 * t, R = N - n < 4 ? N - n : 4;
    for (int m = 0; m < M; m++) {
      const int8_t *xqm = xq + (size_t)m * K;
      const float *xdm = xd + (size_t)m * G;
      float *ym = y + (size_t)m * N;
      if (R == 4) q8_tile(xqm, xdm, w, scale, bias, ym, 4, n, K, m == 0);
      else q8_tile(xqm, xdm, w, scale, bias, ym, R, n, K, 0);
    }
  }
}

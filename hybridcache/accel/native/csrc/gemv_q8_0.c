/* Linear layers with q8_0 weights (llama.cpp's block layout): y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) where each
   block of 32 weights along K is int8 times its own float16 scale, hc_linear_q8_0.

   The activations are quantized the same way at run time (per row, per block of 32: d = max|x| / 127, q =
   round-to-nearest-even(x * (1 / d)), d kept in float32), so each block's dot product is a sum of 32 int8 x int8
   products, exact in int32; the float work is one multiply-add per block: y += (d_w * d_x) * isum. On avx2 the 32
   products take 3 integer ops (`_mm256_maddubs_epi16` on |w| and x with w's sign, `_mm256_madd_epi16` to int32) where
   widening int8 weights to float costs 2 ops per 8 weights before the float multiply-add (hc_linear_i8); with
   avx512-vnni / avx-vnni one `vpdpbusd`. The same integers either way (|w|, |x| <= 127: the int16 pairs never
   saturate), so every build computes the same block sums; only the float summation order differs from the torch
   recompute (hybridcache/ops/q8_0.py). Rows of w are split over OpenMP threads in tiles of 4. */

#define Q8_BLOCK 32

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

/* The int32 sum of 32 products of one weight block and one activation block, as a vector of partial sums (avx2:
   8 int32 lanes as floats, summed by the caller after scaling) or a scalar. */
#if defined(__AVX2__)
#define Q8_SIMD 1
static inline __m256 q8_block_dot(const int8_t *w, const int8_t *x) {
  __m256i wv = _mm256_loadu_si256((const __m256i *)w), xv = _mm256_loadu_si256((const __m256i *)x);
  __m256i aw = _mm256_sign_epi8(wv, wv), sx = _mm256_sign_epi8(xv, wv); /* |w| (unsigned), x with w's sign */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  __m256i s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#else
  __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
  return _mm256_cvtepi32_ps(s32);
}
static inline float q8_hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
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

/* R (<= 4) rows of w from n against one quantized row of x (xq [K], xd [K / 32]): y[n .. n + R). */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *xq, const float *xd, const int8_t *w,
                                                          const uint16_t *scale, const float *bias, float *y, int R,
                                                          int n, int K, int prefetch) {
  int G = K / Q8_BLOCK;
  const int8_t *w0 = w + (size_t)n * K;
  const uint16_t *s0 = scale + (size_t)n * G;
#if Q8_SIMD
  __m256 acc[4];
  for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
  /* a thread's tiles are consecutive rows: prefetch PF_TILES tiles ahead in order (as gemv.c's batch-1 tile) */
  const uintptr_t ahead = (uintptr_t)w0 + (uintptr_t)PF_TILES * 4 * (size_t)K;
  for (int b = 0; b < G; b++) {
    if (prefetch)
      for (int r = 0; r < R; r++) /* this block reads R x 32 bytes; one line ahead per row half-block */
        __builtin_prefetch((const void *)(ahead + ((size_t)r * K + (size_t)b * Q8_BLOCK)), 0, PF_LOCALITY);
    const int8_t *xb = xq + (size_t)b * Q8_BLOCK;
    float dx = xd[b];
    for (int r = 0; r < R; r++) {
      __m256 p = q8_block_dot(w0 + (size_t)r * K + (size_t)b * Q8_BLOCK, xb);
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(half_to_float(s0[(size_t)r * G + b]) * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float s = q8_hsum(acc[r]);
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

/* A mixture-of-experts block's routed experts for one decode token in one call: GPT-OSS's fused experts
   (hc_oss_experts_step), whose weights are stored input-major (x @ W) with gate and up interleaved by column. The
   router runs before (in torch); the caller checks every expert index. Part of cpu_decode.c. */
#include <string.h>

#include "hc_internal.h"

/* y [N] += x [K] @ W [K, N] (a weight stored input-major, as HF's fused experts hold it): W's rows streamed once,
   the columns in blocks of 64 over the threads where W is large (each y[j] sums over d in order: the same bits on
   any number of threads). */
static void add_xw(const float *x, const float *W, float *y, int K, int N) {
  int blocks = (N + 63) / 64, wide = (size_t)K * N * sizeof(float) >= PARALLEL_BYTES;
  _Pragma("omp parallel for schedule(static) if(wide)") for (int jb = 0; jb < blocks; jb++) {
    int j0 = jb * 64, j1 = j0 + 64 < N ? j0 + 64 : N;
    for (int d = 0; d < K; d++) {
      const float *w = W + (size_t)d * N;
      float xd = x[d];
      int j = j0;
#if VW > 1
      vf xv = vset1(xd);
      for (; j + VW <= j1; j += VW) vstore(y + j, vfma(xv, vload_f32(w + j), vload_f32(y + j)));
#endif
      for (; j < j1; j++) y[j] += xd * w[j];
    }
  }
}

/* GPT-OSS's routed experts for one token x [D] (HF's fused layout, float32): for each of the k slots, expert
   e = idx[s] with weight w[s]: gu = x @ gate_up[e] + gate_up_bias[e] ([E, D, 2I], [E, 2I]; gate and up interleaved
   by column), g = min(gu[2j], limit), u = clamp(gu[2j+1], -limit, limit), a = (u + 1) g sigmoid(alpha g),
   y_s = a @ down[e] + down_bias[e] ([E, I, D], [E, D]); y [D] = sum over the slots in order of w[s] y_s.
   scratch: [2I + I + D] floats. */
void hc_oss_experts_step(const float *x, int D, int I, int k, const int *idx, const float *w, const float *gate_up,
                         const float *gate_up_bias, const float *down, const float *down_bias, float alpha,
                         float limit, float *scratch, float *y) {
  float *gu = scratch, *a = gu + 2 * (size_t)I, *ys = a + I;
  for (int j = 0; j < D; j++) y[j] = 0.0f;
  for (int s = 0; s < k; s++) {
    size_t e = (size_t)idx[s];
    memcpy(gu, gate_up_bias + e * 2 * I, sizeof(float) * 2 * I);
    add_xw(x, gate_up + e * D * 2 * I, gu, D, 2 * I);
    for (int j = 0; j < I; j++) {
      float g = gu[2 * j], u = gu[2 * j + 1];
      g = g > limit ? limit : g;
      u = u > limit ? limit : (u < -limit ? -limit : u);
      a[j] = (u + 1.0f) * g / (1.0f + expf(-g * alpha));
    }
    memcpy(ys, down_bias + e * D, sizeof(float) * D);
    add_xw(a, down + e * I * D, ys, I, D);
    for (int j = 0; j < D; j++) y[j] += w[s] * ys[j];
  }
}

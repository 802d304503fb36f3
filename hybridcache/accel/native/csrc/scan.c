/* The Mamba1 selective scan (hc_selective_scan): prefill and decode steps, state in and out. */
#include "hc_internal.h"

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

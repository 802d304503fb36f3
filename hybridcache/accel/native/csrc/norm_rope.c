/* RMSNorm (hc_rms_norm), the residual add between two norms (hc_residual_norm), rotary embedding (hc_rope) and
   both at once (hc_norm_rope): a decode step's small row-wise work, where per-op dispatch costs more than the
   arithmetic. */
#include "hc_internal.h"

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

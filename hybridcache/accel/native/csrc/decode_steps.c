/* Many layers in one call (hc_decoder_stack, over hc_layer_record) and many greedy decode steps of one row in one
   call (hc_decode_steps, choosing each token with hc_argmax_rows): no interpreter between layers or steps. The
   record states its own layout (hc_layer_record_codes / _size / _names) for the loader to check. */
#include "hc_internal.h"
#include "layer_record.h"

const char *hc_layer_record_codes(void) { return HC_LAYER_RECORD(HC_REC_CODE, HC_REC_NONE); }
int hc_layer_record_size(void) { return (int)sizeof(hc_layer_record); }
const char *hc_layer_record_names(void) { return HC_LAYER_RECORD(HC_REC_NAME_STR, HC_REC_NAME_SEP); }

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

/* x [Dm] = row `tok` of the embedding `embed` [vocab, Dm] of embed_type (3: q8_0, 2: int8, 1: bfloat16, 0: float32),
   widened, times its row scale embed_rs when given, times embed_scale: as the model's embedding (the caller checked
   tok). Shared by the greedy loops (hc_decode_steps, hc_program_steps). */
static void embed_row(float *x, const void *embed, int embed_type, const float *embed_rs, int64_t tok, int Dm,
                      float embed_scale) {
  size_t at = (size_t)tok * Dm;
  if (embed_type == 3) { /* q8_0 rows: each block of 32 times its float16 scale, then the multiplier (as torch) */
    const int8_t *row = (const int8_t *)embed + at;
    const uint16_t *bs = (const uint16_t *)embed_rs + (size_t)tok * (Dm / Q8_BLOCK);
    for (int d = 0; d < Dm; d++) x[d] = ((float)row[d] * half_to_float(bs[d / Q8_BLOCK])) * embed_scale;
  } else if (embed_type == 2) { /* int8 rows widened, times their scale, then the multiplier (two roundings, as torch) */
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
}

/* The head of a greedy step: the final RMSNorm of last [Dm] (norm_w NULL: none) into normed, the head (w_head [V, Dm]
   of head_type) into out [V], its first largest value's index into *tok (hc_argmax_rows, as greedy decoding). 0, or
   -3 where the chosen logit is not finite (a NaN, +inf, or -inf everywhere: no next token). */
static int head_choose(const float *last, const float *norm_w, float norm_eps, float *normed, const void *w_head,
                       int head_type, const float *head_scale, const float *head_bias, int V, int Dm, float *out,
                       int64_t *tok) {
  const float *h = last;
  if (norm_w) {
    hc_rms_norm(last, norm_w, normed, 1, Dm, norm_eps);
    h = normed;
  }
  linear_any(head_type, h, w_head, out, head_scale, head_bias, 1, V, Dm);
  hc_argmax_rows(out, tok, 1, V);
  return isfinite(out[*tok]) ? 0 : -3;
}

/* Greedy decode steps of one row in one call (accel/runs/decode_run.py): no interpreter between steps. From token
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
    embed_row(x, embed, embed_type, embed_rs, tok, Dm, embed_scale);
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
    if (head_choose(last, norm_w, norm_eps, normed, w_head, head_type, head_scale, head_bias, V, Dm, out, &tok)) return -3;
    tokens[j] = tok;
    *done = j + 1;
    for (int e = 0; e < n_eos; e++)
      if (eos[e] == tok) return j + 1;
  }
  return steps;
}

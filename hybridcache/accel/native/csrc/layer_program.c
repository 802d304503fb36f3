/* A decode step's pre-norm layers in one call (hc_layer_program): a program of records, each one kernel call's
   arguments (X-macro field lists below, in the order of the function's parameters), run in order. A recurrent
   pre-norm layer  out = h + mixer(norm(h)) [+ mlp(mlp_norm(h + ...))]  is three records: hc_rms_norm, the mixer's
   one-call step (recurrent_step.c: short conv, Mamba2, Mamba1, gated delta, the delta variants, RG-LRU, grouped
   Mamba1) and hc_pre_norm_tail; an attention layer
   is one hc_decoder_layer record (layer_record.h; hc_attention_layer's, of the same layout, where it has no MLP;
   hc_gated_decoder_layer's, the same layout, where its attention is gated). The same kernels in the same order as the per-layer calls, so the
   same bits, with no interpreter between layers. Each record type states its layout (hc_op_record_codes / _names /
   _size) for the loader to check against the function's declared signature. Part of cpu_decode.c (after
   recurrent_step.c and decode_steps.c). */
#include "hc_internal.h"
#include "layer_record.h"

#define HC_RMS_NORM_FIELDS(X, SEP)                                                                                 \
  X(const float *, x, P) SEP() X(const float *, w, P) SEP() X(float *, y, P) SEP() X(int, rows, I) SEP()           \
  X(int, D, I) SEP() X(float, eps, F)
#define HC_SHORT_CONV_FIELDS(X, SEP)                                                                               \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, D, I) SEP() X(int, K, I) SEP() X(const void *, w_in, P)   \
  SEP() X(int, in_type, I) SEP() X(const float *, in_scale, P) SEP() X(const float *, in_bias, P) SEP()            \
  X(const float *, conv_w, P) SEP() X(const float *, conv_b, P) SEP() X(const float *, state, P) SEP()             \
  X(float *, state_out, P) SEP() X(const void *, w_out, P) SEP() X(int, out_type, I) SEP()                         \
  X(const float *, out_scale, P) SEP() X(const float *, out_bias, P) SEP() X(float *, scratch, P) SEP()            \
  X(float *, y, P)
#define HC_MAMBA2_FIELDS(X, SEP)                                                                                   \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, H, I) SEP() X(int, P, I) SEP()        \
  X(int, G, I) SEP() X(int, N, I) SEP() X(int, K, I) SEP() X(const void *, w_in, P) SEP() X(int, in_type, I) SEP() \
  X(const float *, in_scale, P) SEP() X(const float *, in_bias, P) SEP() X(const float *, conv_w, P) SEP()         \
  X(const float *, conv_b, P) SEP() X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP()            \
  X(const float *, dt_bias, P) SEP() X(const float *, A_log, P) SEP() X(const float *, Dskip, P) SEP()             \
  X(float, dt_lo, F) SEP() X(float, dt_hi, F) SEP() X(const float *, ssm_state, P) SEP() X(float *, ssm_out, P)    \
  SEP() X(int, norm, I) SEP() X(const float *, norm_w, P) SEP() X(float, norm_eps, F) SEP()                        \
  X(const void *, w_out, P) SEP() X(int, out_type, I) SEP() X(const float *, out_scale, P) SEP()                   \
  X(const float *, out_bias, P) SEP() X(float *, scratch, P) SEP() X(float *, y, P)
#define HC_MAMBA_FIELDS(X, SEP)                                                                                    \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, Di, I) SEP() X(int, N, I) SEP()       \
  X(int, K, I) SEP() X(int, R, I) SEP() X(const void *, w_in, P) SEP() X(int, in_type, I) SEP()                    \
  X(const float *, in_scale, P) SEP() X(const float *, in_bias, P) SEP() X(const float *, conv_w, P) SEP()         \
  X(const float *, conv_b, P) SEP() X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP()            \
  X(const void *, w_x, P) SEP() X(int, x_type, I) SEP() X(const float *, x_scale, P) SEP()                         \
  X(const float *, dt_norm, P) SEP() X(float, dt_eps, F) SEP() X(const float *, b_norm, P) SEP()                   \
  X(float, b_eps, F) SEP() X(const float *, c_norm, P) SEP() X(float, c_eps, F) SEP() X(const void *, w_dt, P)     \
  SEP() X(int, dt_type, I) SEP() X(const float *, dt_scale, P) SEP() X(const float *, dt_bias, P) SEP()            \
  X(const float *, A_log, P) SEP() X(const float *, Dskip, P) SEP() X(const float *, ssm_state, P) SEP()           \
  X(float *, ssm_out, P) SEP() X(const void *, w_out, P) SEP() X(int, out_type, I) SEP()                           \
  X(const float *, out_scale, P) SEP() X(const float *, out_bias, P) SEP() X(float *, scratch, P) SEP()            \
  X(float *, y, P)
#define HC_GATED_DELTA_FIELDS(X, SEP)                                                                              \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, Hk, I) SEP() X(int, Hv, I) SEP()      \
  X(int, Dk, I) SEP() X(int, Dv, I) SEP() X(int, K, I) SEP() X(const void *, w_qkvz, P) SEP()                      \
  X(int, qkvz_type, I) SEP() X(const float *, qkvz_scale, P) SEP() X(const void *, w_ba, P) SEP()                  \
  X(int, ba_type, I) SEP() X(const float *, ba_scale, P) SEP() X(const float *, conv_w, P) SEP()                   \
  X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP() X(const float *, dt_bias, P) SEP()           \
  X(const float *, A_log, P) SEP() X(float, beta_scale, F) SEP() X(const float *, rec_state, P) SEP()              \
  X(float *, rec_out, P) SEP() X(const float *, norm_w, P) SEP() X(float, norm_eps, F) SEP()                       \
  X(const void *, w_out, P) SEP() X(int, out_type, I) SEP() X(const float *, out_scale, P) SEP()                   \
  X(float *, scratch, P) SEP() X(float *, y, P)
#define HC_DELTA_FIELDS(X, SEP)                                                                                    \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, Hk, I) SEP() X(int, Hv, I) SEP()      \
  X(int, Dk, I) SEP() X(int, Dv, I) SEP() X(int, K, I) SEP() X(int, P, I) SEP() X(const void *const *, w, P) SEP() \
  X(const int *, types, P) SEP() X(const void *const *, scales, P) SEP() X(const int *, rows, P) SEP()             \
  X(const int *, src, P) SEP() X(int, n_qkv, I) SEP() X(const void *const *, conv_w, P) SEP()                      \
  X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP() X(int, iz, I) SEP() X(int, ib, I) SEP()      \
  X(int, ia, I) SEP() X(int, decay, I) SEP() X(float, lower_bound, F) SEP() X(const float *, dt_bias, P) SEP()     \
  X(const float *, A_log, P) SEP() X(float, beta_scale, F) SEP() X(const float *, rec_state, P) SEP()              \
  X(float *, rec_out, P) SEP() X(int, gate, I) SEP() X(const float *, norm_w, P) SEP() X(float, norm_eps, F) SEP() \
  X(const void *, w_out, P) SEP() X(int, out_type, I) SEP() X(const float *, out_scale, P) SEP()                   \
  X(float *, scratch, P) SEP() X(float *, y, P)
#define HC_RGLRU_FIELDS(X, SEP)                                                                                    \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, W, I) SEP() X(int, H, I) SEP()        \
  X(int, K, I) SEP() X(const void *, w_y, P) SEP() X(int, y_type, I) SEP() X(const float *, y_scale, P) SEP()      \
  X(const float *, y_bias, P) SEP() X(const void *, w_x, P) SEP() X(int, x_type, I) SEP()                          \
  X(const float *, x_scale, P) SEP() X(const float *, x_bias, P) SEP() X(const float *, conv_w, P) SEP()           \
  X(const float *, conv_b, P) SEP() X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP()            \
  X(const float *, ig_w, P) SEP() X(const float *, ig_b, P) SEP() X(const float *, rg_w, P) SEP()                  \
  X(const float *, rg_b, P) SEP() X(const float *, rec_param, P) SEP() X(const int64_t *, pos, P) SEP()            \
  X(const float *, lru_state, P) SEP() X(float *, lru_out, P) SEP() X(const void *, w_out, P) SEP()                \
  X(int, out_type, I) SEP() X(const float *, out_scale, P) SEP() X(const float *, out_bias, P) SEP()               \
  X(float *, scratch, P) SEP() X(float *, y, P)
#define HC_MAMBA_GROUPS_FIELDS(X, SEP)                                                                             \
  X(const float *, x, P) SEP() X(int, B, I) SEP() X(int, Dm, I) SEP() X(int, Di, I) SEP() X(int, N, I) SEP()       \
  X(int, K, I) SEP() X(int, R, I) SEP() X(int, G, I) SEP() X(const void *, w_in, P) SEP() X(int, in_type, I) SEP() \
  X(const float *, in_scale, P) SEP() X(const float *, in_bias, P) SEP() X(const float *, conv_w, P) SEP()         \
  X(const float *, conv_b, P) SEP() X(const float *, conv_state, P) SEP() X(float *, conv_out, P) SEP()            \
  X(const float *, x_w, P) SEP() X(const float *, dt_w, P) SEP() X(const float *, dt_bias, P) SEP()                \
  X(const float *, A_log, P) SEP() X(const float *, Dskip, P) SEP() X(const float *, ssm_state, P) SEP()           \
  X(float *, ssm_out, P) SEP() X(const void *, w_out, P) SEP() X(int, out_type, I) SEP()                           \
  X(const float *, out_scale, P) SEP() X(const float *, out_bias, P) SEP() X(float *, scratch, P) SEP()            \
  X(float *, y, P)
#define HC_PRE_NORM_TAIL_FIELDS(X, SEP)                                                                            \
  X(const float *, h, P) SEP() X(const float *, y, P) SEP() X(int, M, I) SEP() X(int, D, I) SEP()                  \
  X(const float *, pre_mlp, P) SEP() X(float, pre_mlp_eps, F) SEP() X(int, I, I) SEP() X(const void *, w_gu, P)    \
  SEP() X(int, gu_type, I) SEP() X(const float *, gu_scale, P) SEP() X(const float *, gu_bias, P) SEP()            \
  X(const void *, w_dn, P) SEP() X(int, dn_type, I) SEP() X(const float *, dn_scale, P) SEP()                      \
  X(const float *, dn_bias, P) SEP() X(int, act, I) SEP() X(float *, scratch, P) SEP() X(float *, out, P)

#define HC_PRE_NORM_MLP_FIELDS(X, SEP)                                                                             \
  X(const float *, h, P) SEP() X(int, M, I) SEP() X(int, D, I) SEP() X(const float *, norm, P) SEP()               \
  X(float, eps, F) SEP() X(int, I, I) SEP() X(const void *, w_up, P) SEP() X(int, up_type, I) SEP()                \
  X(const float *, up_scale, P) SEP() X(const float *, up_bias, P) SEP() X(const void *, w_dn, P) SEP()            \
  X(int, dn_type, I) SEP() X(const float *, dn_scale, P) SEP() X(const float *, dn_bias, P) SEP() X(int, act, I)   \
  SEP() X(float *, scratch, P) SEP() X(float *, out, P)

/* A pre-norm layer whose only branch is an ungated MLP (Nemotron-H's MLP blocks), M rows of D:
   out = h + down(act(up(rms_norm(h) * norm))); act 0: squared ReLU as torch's relu then square (a NaN stays NaN).
   The same kernels in the same order as the norm's, the projections' and the add of the module calls.
   scratch: [M, 2 D + 2 I] floats. */
void hc_pre_norm_mlp(HC_PRE_NORM_MLP_FIELDS(HC_REC_FIELD, HC_REC_COMMA)) {
  size_t md = (size_t)M * D, mi = (size_t)M * I;
  float *x = scratch, *u = x + md, *m = u + 2 * mi;
  hc_rms_norm(h, norm, x, M, D, eps);
  linear_any(up_type, x, w_up, u, up_scale, up_bias, M, I, D);
  if (act == 0)
    for (size_t i = 0; i < mi; i++) {
      float r = u[i] < 0.0f ? 0.0f : u[i];
      u[i] = r * r;
    }
  linear_any(dn_type, u, w_dn, m, dn_scale, dn_bias, M, D, I);
  hc_residual_norm(h, m, NULL, 0.0f, NULL, 0.0f, out, NULL, M, D);
}

#define HC_SANDWICH_TAIL_FIELDS(X, SEP)                                                                            \
  X(const float *, h, P) SEP() X(const float *, y, P) SEP() X(int, M, I) SEP() X(int, D, I) SEP()                  \
  X(const float *, post, P) SEP() X(float, post_eps, F) SEP() X(const float *, pre_mlp, P) SEP()                   \
  X(float, pre_mlp_eps, F) SEP() X(int, I, I) SEP() X(const void *, w_gu, P) SEP() X(int, gu_type, I) SEP()        \
  X(const float *, gu_scale, P) SEP() X(const float *, gu_bias, P) SEP() X(const void *, w_dn, P) SEP()            \
  X(int, dn_type, I) SEP() X(const float *, dn_scale, P) SEP() X(const float *, dn_bias, P) SEP() X(int, act, I)   \
  SEP() X(const float *, post_mlp, P) SEP() X(float, post_mlp_eps, F) SEP() X(float *, scratch, P) SEP()           \
  X(float *, out, P)

/* A sandwich-norm layer after its (recurrent) mixer, M rows of D (LFM3's conv layers): h1 = h + post(y), x =
   rms_norm(h1) * pre_mlp, out = h1 + post_mlp(the gated MLP of x); a post norm NULL: none. hc_decoder_tail without
   its o_proj: the same kernels in the same order as the module calls. scratch: [M, 3 D + 3 I] floats. */
void hc_sandwich_tail(HC_SANDWICH_TAIL_FIELDS(HC_REC_FIELD, HC_REC_COMMA)) {
  size_t md = (size_t)M * D;
  float *h1 = scratch, *x = h1 + md, *m = x + md, *mlp = m + md;
  hc_residual_norm(h, y, post, post_eps, pre_mlp, pre_mlp_eps, h1, x, M, D);
  hc_gated_mlp(x, M, D, I, w_gu, gu_type, gu_scale, gu_bias, w_dn, dn_type, dn_scale, dn_bias, act, mlp, m);
  hc_residual_norm(h1, m, post_mlp, post_mlp_eps, NULL, 0.0f, out, NULL, M, D);
}

/* A pre-norm layer after its mixer, M rows of D: out = h + y without an MLP (w_gu NULL); else h1 = h + y,
   x = rms_norm(h1) * pre_mlp (NULL: x = h1), out = h1 + the gated MLP of x (hc_gated_mlp). The same kernels in the
   same order as residual_norm, GatedMLP and the final add. scratch: [M, 3 D + 3 I] floats (none without an MLP). */
void hc_pre_norm_tail(HC_PRE_NORM_TAIL_FIELDS(HC_REC_FIELD, HC_REC_COMMA)) {
  if (!w_gu) {
    hc_residual_norm(h, y, NULL, 0.0f, NULL, 0.0f, out, NULL, M, D);
    return;
  }
  size_t md = (size_t)M * D;
  float *h1 = scratch, *x = h1 + md, *m = x + md, *mlp = m + md;
  hc_residual_norm(h, y, NULL, 0.0f, pre_mlp, pre_mlp_eps, h1, x, M, D);
  hc_gated_mlp(pre_mlp ? x : h1, M, D, I, w_gu, gu_type, gu_scale, gu_bias, w_dn, dn_type, dn_scale, dn_bias, act,
               mlp, m);
  hc_residual_norm(h1, m, NULL, 0.0f, NULL, 0.0f, out, NULL, M, D);
}

typedef struct { HC_RMS_NORM_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_rms_norm_record;
typedef struct { HC_SHORT_CONV_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_short_conv_record;
typedef struct { HC_MAMBA2_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_mamba2_record;
typedef struct { HC_MAMBA_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_mamba_record;
typedef struct { HC_GATED_DELTA_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_gated_delta_record;
typedef struct { HC_PRE_NORM_TAIL_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_pre_norm_tail_record;
typedef struct { HC_DELTA_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_delta_record;
typedef struct { HC_RGLRU_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_rglru_record;
typedef struct { HC_MAMBA_GROUPS_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_mamba_groups_record;
typedef struct { HC_PRE_NORM_MLP_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_pre_norm_mlp_record;
typedef struct { HC_SANDWICH_TAIL_FIELDS(HC_REC_FIELD, HC_REC_SEMI); } hc_sandwich_tail_record;

/* The op codes of hc_layer_program (accel/native/layer_program.py OPS lists them in this order; a new op goes at
   the end: a code keeps its meaning). */
enum {
  OP_DECODER_LAYER,
  OP_RMS_NORM,
  OP_SHORT_CONV,
  OP_MAMBA2,
  OP_MAMBA,
  OP_GATED_DELTA,
  OP_PRE_NORM_TAIL,
  OP_DELTA,
  OP_RGLRU,
  OP_MAMBA_GROUPS,
  OP_PRE_NORM_MLP,
  OP_SANDWICH_TAIL,
  OP_ATTENTION_LAYER,
  OP_GATED_DECODER_LAYER,
  OP_COUNT
};

#define HC_OP_LAYOUTS(Y)                                                                                           \
  Y(OP_DECODER_LAYER, hc_layer_record, HC_LAYER_RECORD) Y(OP_RMS_NORM, hc_rms_norm_record, HC_RMS_NORM_FIELDS)     \
  Y(OP_SHORT_CONV, hc_short_conv_record, HC_SHORT_CONV_FIELDS) Y(OP_MAMBA2, hc_mamba2_record, HC_MAMBA2_FIELDS)    \
  Y(OP_MAMBA, hc_mamba_record, HC_MAMBA_FIELDS) Y(OP_GATED_DELTA, hc_gated_delta_record, HC_GATED_DELTA_FIELDS)    \
  Y(OP_PRE_NORM_TAIL, hc_pre_norm_tail_record, HC_PRE_NORM_TAIL_FIELDS) Y(OP_DELTA, hc_delta_record, HC_DELTA_FIELDS) \
  Y(OP_RGLRU, hc_rglru_record, HC_RGLRU_FIELDS) Y(OP_MAMBA_GROUPS, hc_mamba_groups_record, HC_MAMBA_GROUPS_FIELDS) \
  Y(OP_PRE_NORM_MLP, hc_pre_norm_mlp_record, HC_PRE_NORM_MLP_FIELDS)                                                \
  Y(OP_SANDWICH_TAIL, hc_sandwich_tail_record, HC_SANDWICH_TAIL_FIELDS)                                            \
  Y(OP_ATTENTION_LAYER, hc_layer_record, HC_LAYER_RECORD)                                                         \
  Y(OP_GATED_DECODER_LAYER, hc_layer_record, HC_LAYER_RECORD)
#define HC_OP_CODES(OP, T, F) case OP: return F(HC_REC_CODE, HC_REC_NONE);
#define HC_OP_NAMES(OP, T, F) case OP: return F(HC_REC_NAME_STR, HC_REC_NAME_SEP);
#define HC_OP_SIZE(OP, T, F) case OP: return (int)sizeof(T);

/* Each op's record layout: its fields' ctypes codes, names (comma-separated) and size; "" / 0 for an unknown op. */
const char *hc_op_record_codes(int op) {
  switch (op) { HC_OP_LAYOUTS(HC_OP_CODES) }
  return "";
}
const char *hc_op_record_names(int op) {
  switch (op) { HC_OP_LAYOUTS(HC_OP_NAMES) }
  return "";
}
int hc_op_record_size(int op) {
  switch (op) { HC_OP_LAYOUTS(HC_OP_SIZE) }
  return 0;
}
int hc_op_count(void) { return OP_COUNT; }

/* Run the n records in order: records[i] is a record of op ops[i] (the caller checked every field as the op's
   own wrapper does, and pointed each layer's input at the previous layer's output). Returns 0, or the first failing
   record's code (-4: an unknown op, nothing of it run; else hc_decoder_layer's) with its index in *failed (the
   records before it ran). */
int hc_layer_program(const int *ops, const void *const *records, int n, int *failed) {
  for (int i = 0; i < n; i++) {
    int err = 0;
    switch (ops[i]) {
    case OP_DECODER_LAYER: {
      const hc_layer_record *r = (const hc_layer_record *)records[i];
      err = hc_decoder_layer(HC_LAYER_RECORD(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_RMS_NORM: {
      const hc_rms_norm_record *r = (const hc_rms_norm_record *)records[i];
      hc_rms_norm(HC_RMS_NORM_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_SHORT_CONV: {
      const hc_short_conv_record *r = (const hc_short_conv_record *)records[i];
      hc_short_conv_step(HC_SHORT_CONV_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_MAMBA2: {
      const hc_mamba2_record *r = (const hc_mamba2_record *)records[i];
      hc_mamba2_step(HC_MAMBA2_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_MAMBA: {
      const hc_mamba_record *r = (const hc_mamba_record *)records[i];
      hc_mamba_step(HC_MAMBA_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_GATED_DELTA: {
      const hc_gated_delta_record *r = (const hc_gated_delta_record *)records[i];
      hc_gated_delta_step(HC_GATED_DELTA_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_PRE_NORM_TAIL: {
      const hc_pre_norm_tail_record *r = (const hc_pre_norm_tail_record *)records[i];
      hc_pre_norm_tail(HC_PRE_NORM_TAIL_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_DELTA: {
      const hc_delta_record *r = (const hc_delta_record *)records[i];
      hc_delta_step(HC_DELTA_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_RGLRU: {
      const hc_rglru_record *r = (const hc_rglru_record *)records[i];
      hc_rglru_step(HC_RGLRU_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_MAMBA_GROUPS: {
      const hc_mamba_groups_record *r = (const hc_mamba_groups_record *)records[i];
      hc_mamba_groups_step(HC_MAMBA_GROUPS_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_PRE_NORM_MLP: {
      const hc_pre_norm_mlp_record *r = (const hc_pre_norm_mlp_record *)records[i];
      hc_pre_norm_mlp(HC_PRE_NORM_MLP_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_SANDWICH_TAIL: {
      const hc_sandwich_tail_record *r = (const hc_sandwich_tail_record *)records[i];
      hc_sandwich_tail(HC_SANDWICH_TAIL_FIELDS(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_ATTENTION_LAYER: {
      const hc_layer_record *r = (const hc_layer_record *)records[i];
      err = hc_attention_layer(HC_LAYER_RECORD(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    case OP_GATED_DECODER_LAYER: {
      const hc_layer_record *r = (const hc_layer_record *)records[i];
      err = hc_gated_decoder_layer(HC_LAYER_RECORD(HC_REC_ARG, HC_REC_COMMA));
      break;
    }
    default:
      err = -4;
    }
    if (err) {
      *failed = i;
      return err;
    }
  }
  return 0;
}

/* Greedy decode steps of one row over a layer program (accel/runs/program_run.py): hc_decode_steps's loop, the layers
   being hc_layer_program's records. Step jj (the run's step s = from + jj) embeds its token into x [Dm] (the input
   the program's first records read; embed_row), moves the records in place: each attention record records[att[a]]
   to slot held[a] + s of S = held[a] + s + 1, query position qpos + jj and row jj of the [steps, rot] rotary tables
   cos_tabs / sin_tabs[rope[a]] (rope[a] < 0: none); each state pointer (the pointer field at byte offset mv_off[m] of
   records[mv_rec[m]]) to buffer (s - 1) mod mv_size[m] (mv_write[m] 0: the state the step reads) or s mod
   mv_size[m] (1: the one it writes) of the ring at mv_base[m], buffers mv_stride[m] bytes apart. Then it runs the
   program, and the final norm, head and argmax read its output `last` [Dm] (head_choose). Returns as
   hc_decode_steps (-1: a record failed). The caller checked every record, offset, ring, table and buffer. */
int hc_program_steps(const int *ops, void *const *records, int n, int from, const int *att, const long *held,
                     const int *rope, int n_att, const float *const *cos_tabs, const float *const *sin_tabs,
                     const int64_t *qpos, const int *mv_rec, const long *mv_off, char *const *mv_base,
                     const long *mv_stride, const int *mv_size, const int *mv_write, int n_mv, int steps,
                     const void *embed, int embed_type, const float *embed_rs, long vocab, float embed_scale,
                     const float *norm_w, float norm_eps, const void *w_head, int head_type, const float *head_scale,
                     const float *head_bias, int V, float *x, const float *last, int Dm, float *normed, float *logits,
                     int keep, const int64_t *eos, int n_eos, int64_t first, int64_t *tokens, int *done) {
  *done = 0;
  if (n < 1 || steps < 1) return 0;
  int64_t tok = first;
  for (int jj = 0; jj < steps; jj++) {
    long s = (long)from + jj;
    if (tok < 0 || tok >= vocab) return -2;
    embed_row(x, embed, embed_type, embed_rs, tok, Dm, embed_scale);
    for (int a = 0; a < n_att; a++) {
      hc_layer_record *r = (hc_layer_record *)records[att[a]];
      r->slot = held[a] + s, r->S = (int)(held[a] + s + 1), r->qpos = qpos + jj;
      if (rope[a] >= 0) {
        r->cos_t = cos_tabs[rope[a]] + (size_t)jj * r->rot;
        r->sin_t = sin_tabs[rope[a]] + (size_t)jj * r->rot;
      }
    }
    for (int m = 0; m < n_mv; m++) {
      long size = mv_size[m], at = mv_write[m] ? s % size : (s - 1 + size) % size;
      char *p = mv_base[m] + at * mv_stride[m];
      memcpy((char *)records[mv_rec[m]] + mv_off[m], &p, sizeof p);
    }
    int failed = -1;
    if (hc_layer_program(ops, (const void *const *)records, n, &failed)) return -1;
    float *out = logits + (keep ? (size_t)jj * V : 0);
    if (head_choose(last, norm_w, norm_eps, normed, w_head, head_type, head_scale, head_bias, V, Dm, out, &tok)) return -3;
    tokens[jj] = tok;
    *done = jj + 1;
    for (int e = 0; e < n_eos; e++)
      if (eos[e] == tok) return jj + 1;
  }
  return steps;
}

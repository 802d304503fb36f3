/* The parameters of a decode step's attention (hc_attention_step) and decoder layer (hc_decoder_layer), listed once
   as X-macros, and the layer record hc_decoder_stack / hc_decode_steps take. Part of cpu_decode.c. */
#ifndef HC_LAYER_RECORD_H
#define HC_LAYER_RECORD_H

/* ---- a decode step's attention / decoder layer in one call, and many layers in one call --------------------
   The parameters of hc_attention_step (HC_STEP_FIELDS) and hc_decoder_layer (those, then HC_TAIL_FIELDS), listed
   once (X: a parameter's C type, name and ctypes code). hc_decoder_stack takes hc_decoder_layer's arguments as a
   record, one per layer, and runs the records in order: no interpreter between layers, whose Python ran with the
   caches cold after each layer's weights (measured on a 2-core Xeon, Gemma 3 270M with int8 weights: the layers'
   Python 4.4 -> 1.9 ms a step, the step 16.8 -> ~13.7 ms). The record's type codes let the loader check it against
   the op's declared signature (op_declarations.py) before any call. */
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

typedef struct {
  HC_LAYER_RECORD(HC_REC_FIELD, HC_REC_SEMI);
} hc_layer_record;

#endif /* HC_LAYER_RECORD_H */

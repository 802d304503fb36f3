/* The CPU decode kernels: one library, hybridcache/accel/native/build.py compiles this file (-O3 -march=native, -fopenmp
   where the compiler takes it: without it every kernel runs on one thread) and verifies every file of this
   directory (its build key and the library's manifest cover them all).

   One translation unit: the op-family files are included here, in this order (a file may use what an earlier one
   defines), so the compiler sees every kernel at once and inlines across families exactly as it did when they were
   one file (the fused layer and step loop call the GEMV, norm and attention kernels): the same code, the same bits,
   the same speed. hc_internal.h (the ISA layer, shared helpers) and layer_record.h (the layer record's fields) are
   the shared headers.

   Safety: no array here is sized or indexed by a caller's size (fixed-size arrays only, indexed below their constant
   bounds); scratch memory comes from malloc and a failed allocation is reported (hc_decode_attention returns
   nonzero), never written through. The Python wrappers (hybridcache/accel) check every size, dtype, device and
   stride before a call; the kernels still tolerate zero sizes and a chunk / window <= 0 (nothing visible). */
#include "hc_internal.h"

const char *hc_isa(void) { return ISA; }
/* Whether this build runs on OpenMP threads, and how many a parallel region gets. */
int hc_openmp(void) { return HC_OPENMP; }
int hc_threads(void) { return omp_get_max_threads(); }

#include "gemv.c"
#include "gemv_q8_0.c"
#include "norm_rope.c"
#include "attention.c"
#include "scan.c"
#include "fused_layer.c"
#include "recurrent_step.c"
#include "moe_step.c"
#include "decode_steps.c"
#include "layer_program.c"
#include "gemm.c"

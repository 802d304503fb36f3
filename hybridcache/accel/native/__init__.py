"""The C kernels and everything that touches them directly: the build that compiles and verifies csrc/ on first use
(build.py, library.py), the checked ctypes wrappers per op family (attention, attention_step, rows, fused,
decoder_layer, decoder_stack; kernels.py the CPU decode entry points), the declared op signatures and rules
(op_declarations.py), their `hybridcache::<op>` torch ops and pure-torch references (op_registry.py, op_reference.py),
and
how the seam calls them (kernel_calls.py). No argument reaches C before its wrapper has checked it (checks.py)."""

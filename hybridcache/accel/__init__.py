"""The CPU fast path, plugged into the reference model at two seams.

- Per op: `hybridcache.ops.kernels` (`takes` / `call`): blocks and ops ask it for one op at a time (a projection,
  a norm, rotary, the Mamba scan, one-query attention); importing this package routes it to the C kernels (csrc/,
  built and verified on first use; kernel_calls.py: the wrapper eagerly, the registered `hybridcache::<op>` torch
  op under torch.compile).
- Per module and model: `install(model)` (from_pretrained calls it) gives each module the registry knows its
  `accel` and the model its `fast_path` (install.py). The modules keep the reference computation and offer `accel`
  each call first. The cache is seen only through slots.py's protocols (reserve a slot, write it, commit).

The routes of one eager decode token, fastest first, each falling back to the next where it does not apply:
1. greedy loop (runs/decode_run.py `DecodeRun.greedy`, runs/program_run.py): many greedy steps in one C call;
2. decode run (`DecodeRun.step`): the layers' records reused across steps, the cache fed once per run;
3. layer records (runs/layer_records.py, layers/): one step's recording layers in one C call;
4. per module (`accel`): a layer (layers/sandwich.py) or a mixer (mixers/) in one kernel call;
5. the reference modules, whose ops still reach per-op kernels through the seam.
`kernel_status()` says whether the kernels are built here.
"""

from hybridcache.accel.native import op_registry  # noqa: F401, I001 (registers the hybridcache::<op> torch ops first)
from hybridcache.accel.native import kernel_calls as _kernel_calls
from hybridcache.accel.native.kernels import KernelArgumentError, kernel_status
from hybridcache.ops import kernels as _seam

_seam.plug(_kernel_calls.takes, _kernel_calls.call)

from hybridcache.accel.install import AccelError, FastPath, install, register_accel, uninstall  # noqa: E402
from hybridcache.accel.runs.embed_head import NonFiniteLogits  # noqa: E402
from hybridcache.accel.runs.layer_records import steady, steady_unless_hooked  # noqa: E402

__all__ = [
    "AccelError",
    "FastPath",
    "KernelArgumentError",
    "NonFiniteLogits",
    "install",
    "kernel_status",
    "register_accel",
    "steady",
    "steady_unless_hooked",
    "uninstall",
]

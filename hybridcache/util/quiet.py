"""Silencing what is not ours: other libraries' progress bars and deprecation warnings on normal runs. Our own progress
(rich status lines and bars) stays; errors and our own notices (KernelNotice, "hybridcache: ...") still show."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

FOREIGN = ("transformers", "torch", "huggingface_hub", "wandb", "accelerate", "gguf", "safetensors", "tokenizers")


def ignore_foreign_warnings() -> None:
    """Deprecation and future warnings: ours never raise them, so every one comes from a library (often attributed,
    through stacklevel, to our line that called it, which a module filter alone misses). Other warnings raised inside
    the libraries' own modules too."""
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    for module in FOREIGN:
        warnings.filterwarnings("ignore", module=module)


@contextlib.contextmanager
def quiet_gguf_progress() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors...") with tqdm
    itself, not transformers' logging one, so `disable_progress_bar()` misses it; our status line says what runs."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - a transformers without GGUF support
        yield
        return
    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar

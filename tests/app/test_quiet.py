"""Quiet runs: other libraries' deprecation warnings and progress bars are silenced, ours (rich status lines and
progress bars, our own notices) still show."""

import os
import re
import subprocess
import sys
from pathlib import Path

from hybridcache.util.quiet import quiet_gguf_progress

ROOT = Path(__file__).resolve().parents[2]
FOREIGN_BAR = re.compile(r"\d+it/s\]|it/s\]|\|\s*\d+/\d+ \[|Loading weights|Converting and de-quantizing")

SCRIPT = """
import warnings
import torch
from experiments.core.common import quiet_libraries
quiet_libraries()
with torch.cuda.amp.autocast(enabled=False):  # torch's FutureWarning, attributed (stacklevel) to this line
    pass
warnings.warn("hybridcache: our own notice", UserWarning)
print("done")
"""


def test_foreign_deprecation_attributed_to_our_line_is_silenced_ours_is_not():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "deprecat" not in out.stderr.lower() and "FutureWarning" not in out.stderr
    assert "hybridcache: our own notice" in out.stderr


def test_gguf_conversion_bar_is_silenced_only_inside(capfd):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting and de-quantizing" in capfd.readouterr().err  # the bar draws by default: the check has teeth
    with quiet_gguf_progress():
        list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert capfd.readouterr().err == ""
    list(gguf_utils.tqdm(range(3), desc="restored"))
    assert "restored" in capfd.readouterr().err


def test_app_run_has_our_progress_and_no_foreign_noise(tmp_path):
    """A short correctness run with the HF reference (loads HF weights, generates with HF), on a terminal-like
    console (TTY_COMPATIBLE: rich draws its live status and bars, as a user sees them)."""
    env = {
        **os.environ, "TTY_COMPATIBLE": "1", "COLUMNS": "120", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    out = subprocess.run(
        [
            sys.executable, "run.py", "model=gemma3", "max_new_tokens=2", "prompts.texts=[hello there]",
            "reference=hf", f"hydra.run.dir={tmp_path / 'out'}",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    both = out.stdout + out.stderr
    assert "deprecat" not in both.lower() and "Warning" not in both
    assert not FOREIGN_BAR.search(both), FOREIGN_BAR.search(both)
    # ours: the loading status line and the progress bars of our generations and the reference's
    assert "loading gemma3" in out.stdout and "ours + oracle" in out.stdout and "reference (hf)" in out.stdout

"""A model built to ignore its SSM state, for the tests of the controls: a trained Bamba with the C channels of every
Mamba2 conv cut (weights and bias zero), so C = silu(0) = 0 and each mixer outputs D * x + 0 * state: the SSM
states are still computed and cached but nothing reads them. Its conv states and attention still matter."""

from pathlib import Path

import torch
import transformers


def cut_ssm_readout(source: Path, target: Path) -> Path:
    """Copy the HF checkpoint at `source` to `target` with every Mamba2 mixer's state readout (C) cut."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    cut = 0
    with torch.no_grad():
        for mixer in (m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "conv1d")):
            # conv channels: x (intermediate), B (groups * state), C (groups * state)
            c = mixer.n_groups * mixer.ssm_state_size
            mixer.conv1d.weight[-c:].zero_()
            if mixer.conv1d.bias is not None:
                mixer.conv1d.bias[-c:].zero_()
            cut += 1
    assert cut, f"{source} has no Mamba2 mixer"
    model.save_pretrained(target)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target

"""A model family written outside hybridcache (examples/plugins/falcon_mamba), installed the way a user would
(`pip install --target`), found through its entry point, and checked against HF transformers' own FalconMamba."""

from pathlib import Path

import pytest
import transformers

from hybridcache.models.core.registry import BUILTIN
from tests.models.plugin_helpers import ROOT, install_plugin, run_fresh, save_tiny

# Runs in a fresh interpreter that has the plugin's install target on its path: nothing imports the plugin by
# name, from_pretrained finds it by the checkpoint's model_type through the entry point.
CHECK = r"""
import json, sys
import torch, transformers
import hybridcache as hc
from hybridcache.models import available_families

path = sys.argv[1]
ours = hc.from_pretrained(path)
ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.randint(3, 384, (1, 21), generator=torch.Generator().manual_seed(1))
out = {"families": available_families(), "class": type(ours).__module__ + "." + type(ours).__name__}
with torch.no_grad():
    full = ref(ids).logits  # [1, 21, V]
    out["forward"] = (ours(ids) - full).abs().max().item()
    cache = ours.make_cache(1)  # continuation: 13 tokens, then the other 8 on the same cache
    head = ours(ids[:, :13], cache=cache)
    tail = ours(ids[:, 13:], cache=cache)
    out["continuation"] = max((head - full[:, :13]).abs().max().item(), (tail - full[:, 13:]).abs().max().item())
    gen = hc.generate(ours, ids, max_new_tokens=24)
    hf = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    out["tokens_equal"] = bool(torch.equal(gen.sequences, hf.sequences))
    out["generate"] = (gen.logits - torch.stack(hf.logits, 1)).abs().max().item()
    out["new_tokens"] = len(set(gen.sequences[0, 21:].tolist()))
print(json.dumps(out))
"""


def tiny_falcon_mamba(path: Path) -> Path:
    """A tiny random HF FalconMamba checkpoint (HF's own classes; weights drawn like the in-tree tiny models)."""
    config = transformers.FalconMambaConfig(
        vocab_size=384,
        hidden_size=64,
        state_size=8,
        num_hidden_layers=3,
        expand=2,
        conv_kernel=4,
        time_step_rank=8,
        mixer_rms_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return save_tiny(transformers.FalconMambaForCausalLM, config, path)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_plugin(tmp_path_factory, "falcon_mamba")


def test_falcon_mamba_is_not_in_tree():
    assert "falcon_mamba" not in BUILTIN
    assert not list((ROOT / "hybridcache").rglob("*falcon_mamba*"))


def test_installed_plugin_family_matches_hf(installed, tmp_path):
    checkpoint = tiny_falcon_mamba(tmp_path / "falcon_mamba")
    out = run_fresh(installed, CHECK, str(checkpoint), timeout=300)
    assert "falcon_mamba" in out["families"]
    assert out["class"] == "hybridcache_falcon_mamba.FalconMambaLM"
    assert out["forward"] <= 1e-4
    assert out["continuation"] <= 1e-4
    assert out["tokens_equal"]
    assert out["generate"] <= 1e-4
    assert out["new_tokens"] > 3  # the greedy continuation is not one repeated token (a test with teeth)

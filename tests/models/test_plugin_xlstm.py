"""xLSTM written outside hybridcache (examples/plugins/xlstm) with its own cache type (`mlstm`: matrix memory,
normalizer, max-stabilizer), installed the way a user would (`pip install --target`), found through its entry
point, and checked against HF transformers' own xLSTMForCausalLM in a fresh interpreter."""

from pathlib import Path

import pytest
import transformers

from hybridcache.models.core.registry import BUILTIN
from tests.models.plugin_helpers import ROOT, install_plugin, run_fresh, save_tiny
from tests.models.test_plugin_families import CHECK

# The state type through the conformance kit, then against HF: a left-padded batch against each row alone; and in
# float64 (states too): rollback (crop within the checkpoint window equals a recompute of the first n columns) and a
# saved-and-loaded cache continuing like the original and like a no-cache recompute.
EXTRA = r"""
import json, sys
import torch, transformers
import hybridcache as hc
from hybridcache.cache import Cache
from hybridcache.testing import check_cache_type

path, tmp = sys.argv[1], sys.argv[2]
out = {"kit": check_cache_type("mlstm"), "kit_rollback": check_cache_type("mlstm", params={"rollback": 3})}
ours = hc.from_pretrained(path)
ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
g = torch.Generator().manual_seed(2)
a, b = torch.randint(3, 384, (1, 15), generator=g), torch.randint(3, 384, (1, 9), generator=g)
ids = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)])
mask = torch.ones(2, 15, dtype=torch.long)
mask[1, :6] = 0
with torch.no_grad():
    got = ours(ids, ours.make_cache(2), mask)
    out["left_padding"] = max((got[:1] - ref(a).logits).abs().max().item(),
                              (got[1:, 6:] - ref(b).logits).abs().max().item())
    model = ours.to(torch.float64)
    config = {"recurrent": {"rollback": 5, "state_dtype": torch.float64}}
    ids = torch.randint(3, 384, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0
    cache = model.make_cache(2, config)
    model(ids[:, :12], cache, mask[:, :12])
    model(ids[:, 12:17], cache, mask[:, :17])
    for t in range(17, 20):
        model(ids[:, t : t + 1], cache)
    snap, follow, worst = cache.snapshot(), torch.randint(3, 384, (2, 3), generator=g), 0.0
    for n in range(15, 21):
        cache.restore(snap)
        cache.crop(n)
        fresh = model.make_cache(2, config)
        model(ids[:, :n], fresh, mask[:, :n])
        for x, y in zip(cache.layers, fresh.layers):
            worst = max([worst] + [(x.states[k] - y.states[k]).abs().max().item() for k in x.states])
        ext = torch.cat([mask[:, :n], torch.ones(2, 3, dtype=torch.long)], 1)
        worst = max(worst, (model(follow, cache, ext) - model(follow, fresh, ext)).abs().max().item())
    out["rollback"] = worst
    gen = hc.generate(model, ids[:, :11], attention_mask=mask[:, :11], max_new_tokens=4)
    gen.cache.save(tmp + "/c.safetensors")
    loaded = Cache.load(tmp + "/c.safetensors", model=model)
    more = torch.cat([gen.sequences, follow], 1)
    full = torch.cat([mask[:, :11], torch.ones(2, 7, dtype=torch.long)], 1)
    x = hc.generate(model, more, attention_mask=full, cache=gen.cache, max_new_tokens=5)
    y = hc.generate(model, more, attention_mask=full, cache=loaded, max_new_tokens=5)
    z = hc.generate(model, more, attention_mask=full, max_new_tokens=5, use_cache=False)
    out["saved_equal"] = bool(torch.equal(x.sequences, y.sequences) and torch.equal(x.logits, y.logits))
    out["saved_vs_recompute"] = (y.logits - z.logits).abs().max().item()
    out["recompute_tokens_equal"] = bool(torch.equal(y.sequences, z.sequences))
print(json.dumps(out))
"""

# Chunked prefill (chunks of 1, 3, 7 across HF's chunkwise kernel of 16) against one-shot prefill and against HF's
# own greedy generation of the same 21-token prompts, in float32; then exact in float64 (states too) on a left-padded
# batch. The compiled decode step (a preallocated cache, one graph per step) against eager decoding and against HF.
SPLIT_AND_COMPILE = r"""
import json, sys
import torch, transformers
from torch._dynamo.utils import counters
import hybridcache as hc

path = sys.argv[1]
ours = hc.from_pretrained(path)
ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
diff = lambda a, b: (a.double() - b.double()).abs().max().item()
g = torch.Generator().manual_seed(3)
ids = torch.randint(3, 384, (2, 21), generator=g)
hf = ref.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
one = hc.generate(ours, ids, max_new_tokens=6)
chunked = [hc.generate(ours, ids, max_new_tokens=6, prefill_chunk_size=c) for c in (1, 3, 7)]
out = {"split_tokens_equal": all(torch.equal(one.sequences, c.sequences) for c in chunked)}
out["split_f32"] = max(diff(one.logits, c.logits) for c in chunked)
out["split_tokens_equal_hf"] = all(torch.equal(c.sequences, hf.sequences) for c in chunked)
out["split_vs_hf"] = max(diff(c.logits, torch.stack(hf.logits, 1)) for c in chunked)
out["new_tokens"] = len(set(one.sequences[:, 21:].flatten().tolist()))

exact = hc.from_pretrained(path, dtype=torch.float64)
mask = torch.ones_like(ids)
mask[1, :4] = 0
kw = dict(attention_mask=mask, max_new_tokens=4, cache_config={"recurrent": {"state_dtype": torch.float64}})
one64 = hc.generate(exact, ids, **kw)
chunked64 = [hc.generate(exact, ids, prefill_chunk_size=c, **kw) for c in (1, 3, 7)]
out["split_tokens_equal_f64"] = all(torch.equal(one64.sequences, c.sequences) for c in chunked64)
out["split_f64"] = max(diff(one64.logits, c.logits) for c in chunked64)

ids = torch.randint(3, 384, (2, 13), generator=torch.Generator().manual_seed(9))
mask = torch.ones_like(ids)
mask[1, :3] = 0
eager = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
torch._dynamo.reset()
counters.clear()
compiled = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12, compile=True)
out["graph_breaks"] = sum(counters["graph_break"].values())
out["compiled_tokens_equal"] = bool(torch.equal(eager.sequences, compiled.sequences))
out["compiled_vs_eager"] = diff(eager.logits, compiled.logits)
hf = ref.generate(ids[:1], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)  # the unpadded row: HF's recurrent step decodes it
out["compiled_tokens_equal_hf"] = bool(torch.equal(compiled.sequences[:1], hf.sequences))
out["compiled_vs_hf"] = diff(compiled.logits[:1], torch.stack(hf.logits, 1))
print(json.dumps(out))
"""


def tiny_xlstm(path: Path) -> Path:
    """A tiny random HF xLSTM checkpoint (HF's own classes, weights drawn like the in-tree tiny models). chunk_size
    16 puts prompts of 16 tokens or more through HF's chunkwise kernel, shorter ones through its recurrent step."""
    config = transformers.xLSTMConfig(
        vocab_size=384,
        hidden_size=128,  # qk width 64: HF's cache rounds it up to a multiple of 64, its layer does not
        num_hidden_layers=2,
        num_heads=4,
        chunk_size=16,
        autocast_kernel_dtype="float32",
        inference_state_dtype="float32",
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return save_tiny(transformers.xLSTMForCausalLM, config, path)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_plugin(tmp_path_factory, "xlstm")


def test_xlstm_is_not_in_tree():
    assert "xlstm" not in BUILTIN
    assert not list((ROOT / "hybridcache").rglob("*xlstm*"))


def test_installed_plugin_family_matches_hf(installed, tmp_path):
    out = run_fresh(installed, CHECK, str(tiny_xlstm(tmp_path / "xlstm")))
    assert "xlstm" in out["families"]
    assert out["class"] == "hybridcache_xlstm.model.XLSTMLM"
    assert out["forward"] <= 1e-4  # 21 tokens: HF's chunkwise kernel (16) + its recurrent step (5)
    assert out["continuation"] <= 1e-4
    assert out["tokens_equal"]
    assert out["generate"] <= 1e-4
    assert out["new_tokens"] > 3


def test_mlstm_state_kit_padding_rollback_and_save_load(installed, tmp_path):
    out = run_fresh(installed, EXTRA, str(tiny_xlstm(tmp_path / "xlstm")), str(tmp_path))
    assert out["kit"] and out["kit_rollback"]
    assert out["left_padding"] <= 1e-4
    assert out["rollback"] <= 1e-9
    assert out["saved_equal"] and out["recompute_tokens_equal"]
    assert out["saved_vs_recompute"] <= 1e-9


def test_chunked_prefill_and_compiled_decode(installed, tmp_path):
    out = run_fresh(installed, SPLIT_AND_COMPILE, str(tiny_xlstm(tmp_path / "xlstm")))
    assert out["split_tokens_equal"] and out["split_f32"] <= 1e-5  # ORACLE_TOL of the in-tree split cases
    assert out["split_tokens_equal_hf"] and out["split_vs_hf"] <= 1e-4
    assert out["new_tokens"] > 3
    assert out["split_tokens_equal_f64"] and out["split_f64"] <= 1e-9
    assert out["graph_breaks"] == 0
    assert out["compiled_tokens_equal"] and out["compiled_vs_eager"] <= 2e-5  # test_compile.py's bar
    assert out["compiled_tokens_equal_hf"] and out["compiled_vs_hf"] <= 1e-4

"""A decode step's layers in one C call for the families whose recurrent mixers joined the layer program later: the
delta variants (Qwen3.5, OLMo-Hybrid's Gated DeltaNet, Kimi's and Bailing's KDA: hc_delta_step records) and
RecurrentGemma's RG-LRU block (hc_rglru_step records), each layer as its input norm, one-call mixer step and tail;
and Nemotron-H's Mamba2 blocks (a pre-norm layer with no MLP branch; the model offers the fast path its blocks, each
with its run's cache entry).
The oracle is the per-layer path (`record_step` off: every layer its own module call, the mixers' one-call steps
still run): logits, tokens and every cache state must be bit-identical, and the tokens equal to HF transformers'.
Whatever the program does not take (MLA attention, a MoE MLP, OLMo's post-norm attention layers) runs as its module
call between programs."""

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.native import layer_program
from hybridcache.accel.pre_norm_layer import PreNormAccel
from tests.models.conftest import hf_generate, left_padded, prompts
from tests.models.test_pre_norm_records import _cache_state, _per_layer, _programs, _same_cache

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

# family -> the record its recurrent layers run as
FAMILIES = {
    "qwen3_5": "delta",
    "olmo_hybrid": "delta",
    "kimi_linear": "delta",
    "bailing_hybrid": "delta",
    "recurrentgemma": "rglru",
    "nemotron_h": "mamba2",  # (its Mamba2 blocks: pre-norm layers with no MLP branch, each with its run's entry)
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_program_is_the_per_layer_calls(checkpoints, monkeypatch, family):
    model = hc.from_pretrained(checkpoints(family))
    assert any(isinstance(b.__dict__.get("accel"), PreNormAccel) for b in model.modules())
    ids, mask = left_padded(2, 7, seed=5)
    new = 10
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new)
            outs.append((out, calls))
    (got, calls), (want, none) = outs
    assert none == []
    assert sum(ops.count(layer_program.CODES[FAMILIES[family]]) for ops in calls) > 0  # mixers ran as records
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logits, want.logits)
    _same_cache(_cache_state(got.cache), _cache_state(want.cache))


@pytest.mark.parametrize("family", ["qwen3_5", "recurrentgemma", "nemotron_h"])
def test_the_program_gives_hf_tokens(checkpoints, family):
    import transformers

    path = checkpoints(family)
    model = hc.from_pretrained(path)
    ids = prompts(2, 9, seed=3)
    got = hc.generate(model, ids, max_new_tokens=12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_ids, hf_logits = hf_generate(hf, ids, torch.ones_like(ids), 12)
    assert torch.equal(got.sequences, hf_ids)
    torch.testing.assert_close(got.logits, hf_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5", "recurrentgemma"])
def test_checkpoint_trails_and_crop_are_the_per_layer_ones(checkpoints, monkeypatch, family):
    """With recurrent rollback the program hands each step's new states to the cache as the per-layer step does:
    trails, a crop back into them and the steps after it are equal."""
    model = hc.from_pretrained(checkpoints(family))
    ids, config = prompts(1, 6, seed=7), {"recurrent": {"rollback": 3}, "attention": {"type": "full"}}
    # (full attention: RecurrentGemma's sliding window is shorter than the crop)
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, max_new_tokens=6, cache_config=config)
            state = _cache_state(out.cache)
            out.cache.crop(out.cache.seq.seen.max().item() - 2)
            cropped = _cache_state(out.cache)
            more = hc.generate(model, out.sequences[:, :-2], max_new_tokens=4, cache=out.cache)
            outs.append((out.logits, state, cropped, more.logits, _cache_state(more.cache), len(calls)))
    (a, sa, ca, ma, ea, na), (b, sb, cb, mb, eb, nb) = outs
    assert na > 0 and nb == 0
    assert torch.equal(a, b) and torch.equal(ma, mb)
    for x, y in ((sa, sb), (ca, cb), (ea, eb)):
        _same_cache(x, y)


@pytest.mark.parametrize("family", ["qwen3_5", "recurrentgemma"])
def test_int8_states_are_the_per_layer_ones(checkpoints, monkeypatch, family):
    """An int8 state codec decodes the states into tensors only the step's arguments hold until the program runs."""
    model = hc.from_pretrained(checkpoints(family))
    ids, mask = left_padded(2, 7, seed=11)
    config = {"recurrent": {"state_codec": "int8"}}
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=8, cache_config=config)
            outs.append((out.sequences, out.logits, _cache_state(out.cache), len(calls)))
    (sa, la, ca, na), (sb, lb, cb, nb) = outs
    assert na > 0 and nb == 0
    assert torch.equal(sa, sb) and torch.equal(la, lb)
    _same_cache(ca, cb)


def test_a_steady_generation_moves_the_kept_delta_records(checkpoints, monkeypatch):
    """Inside one generate call the delta layers' records are kept and only their states and buffers move (RG-LRU's
    are built anew: they read the step's positions); a second generation on the same cache, where the states
    moved on, equals the per-layer path too."""
    model = hc.from_pretrained(checkpoints("qwen3_5"))
    ids = prompts(1, 5, seed=9)
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            first = hc.generate(model, ids, max_new_tokens=5)
            second = hc.generate(model, first.sequences, max_new_tokens=5, cache=first.cache)
            outs.append((first.logits, second.logits, _cache_state(second.cache)))
    (a1, a2, ca), (b1, b2, cb) = outs
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    _same_cache(ca, cb)

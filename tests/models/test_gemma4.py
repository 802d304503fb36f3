"""Gemma 4 beyond the shared tiny checkpoint: learned scalars away from their init, the variants without KV sharing /
PLE / experts (the dense and MoE checkpoints' shape), the older config.json spelling, the KV-sharing cache layout and
the config checks. HF transformers' Gemma4ForCausalLM (float32) is the reference."""

import json

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import reinit_weights_, tiny_config
from hybridcache.models import model_class
from hybridcache.models.core.family_config import ConfigError
from tests.models.conftest import hf_generate, prompts

PLAIN = dict(  # a dense Gemma 4 (31B's shape): no PLE, no sharing, no experts, values projected
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    enable_moe_block=False,
    use_double_wide_mlp=False,
    attention_k_eq_v=False,
)


def save_hf(path, seed=0, **overrides):
    """A tiny HF Gemma 4 whose layer scalars and router scales are not 1 (HF initialises them to 1)."""
    config = tiny_config("gemma4", attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).float().eval()
    reinit_weights_(model, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
            if config.enable_moe_block:
                layer.router.scale.copy_(0.5 + torch.rand(layer.router.scale.shape, generator=gen))
                layer.router.per_expert_scale.copy_(0.5 + torch.rand(config.num_experts, generator=gen))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("variant", ["shared", "plain"])
def test_matches_hf_with_learned_scalars(tmp_path, variant):
    ref = save_hf(tmp_path, **(PLAIN if variant == "plain" else {}))
    ours = hc.from_pretrained(tmp_path)
    ids = prompts(2, 19, seed=3)  # longer than the window (8): the sliding ring wraps
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask)
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-4
    seq, logits = hf_generate(ref, ids, mask, 12)
    out = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(out.sequences, seq)
    assert (out.logits - logits).abs().max().item() <= 1e-4


def test_the_readers_hold_no_cache_and_read_the_last_writer_of_their_type(tmp_path):
    save_hf(tmp_path)
    ours = hc.from_pretrained(tmp_path)
    cache = ours.make_cache(1)
    assert [type(layer).__name__ for layer in cache] == ["SlidingWindowLayer", "FullAttentionLayer"]
    assert [layer.spec.head_dim for layer in cache] == [64, 128]  # the global layer's own head_dim
    readers = ours.model.layers[2:]
    assert all(not hasattr(b.self_attn, "k_proj") for b in readers)
    assert not hasattr(ours.model.layers[1].self_attn, "v_proj") or ours.model.layers[1].self_attn.v_proj is None
    # the readers' output depends on the writers' keys: zeroing a writer's k_proj changes the last layer's input
    ids = prompts(1, 10, seed=4)
    with torch.no_grad():
        before = ours(ids)
        ours.model.layers[1].self_attn.k_proj.weight.zero_()
        after = ours(ids)
    assert (before - after).abs().max().item() > 1e-3


def test_older_config_spelling_builds_the_same_shapes(tmp_path):
    save_hf(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    older = {k: v for k, v in raw.items() if k != "per_layer_config"}
    older.update(global_head_dim=128, num_global_key_value_heads=1)
    new, old = model_class("gemma4_text")(raw), model_class("gemma4_text")(older)
    assert {k: v.shape for k, v in new.state_dict().items()} == {k: v.shape for k, v in old.state_dict().items()}
    assert new.native_layers() == old.native_layers()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_kv_shared_layers": 4}, r"num_kv_shared_layers \(4\) must be < num_hidden_layers"),
        (
            {"layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]},
            "a KV-shared layer type has no earlier layer of that type",
        ),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        ({"num_experts": None}, "enable_moe_block needs num_experts"),
        ({"per_layer_config": {"1": {"num_key_value_heads": 3}}}, r"layer 1: 2 heads not a multiple of 3 kv heads"),
    ],
)
def test_config_checks(tmp_path, change, message):
    tiny_config("gemma4").save_pretrained(tmp_path)
    raw = {**json.loads((tmp_path / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=message):
        model_class("gemma4_text").config_class.from_hf(raw)


def test_an_early_exit_draft_stops_at_the_layers_with_cache_entries(tmp_path):
    from hybridcache.generation.sources.speculative import EarlyExitDraft
    from hybridcache.models.core.base import GenerationError

    save_hf(tmp_path)
    ours = hc.from_pretrained(tmp_path)
    with pytest.raises(GenerationError, match="at most 2 layers, got 3"):
        EarlyExitDraft(ours, 3)  # layer 2 reads layer 0's K/V: no cache entry of its own
    draft = EarlyExitDraft(ours, 2)
    ids = prompts(1, 9, seed=5)
    plain = hc.generate(ours, ids, max_new_tokens=6).sequences
    drafted = hc.generate(ours, ids, max_new_tokens=6, draft_model=draft, num_draft_tokens=3).sequences
    assert torch.equal(plain, drafted)  # speculative decoding with the draft gives the target's greedy tokens

"""Decoder layers that own several cache layers, expressed with `NativeGroup` and the base `forward_block`:
a FalconH1-style layer (Mamba2 and attention side by side on the same input) and a Zamba2-style stack (a shared
attention block, one set of weights used by several layers, each use with its own KV cache, beside Mamba2).

Tiny stand-ins with random weights (the real families come with their own HF parity tests): exactness is checked
against the `use_cache=False` oracle in float64, chunked prefill and left padding included."""

import pytest
import torch
from torch import nn

import hybridcache as hc
from hybridcache.cache import CacheConfigError, CacheGroup, NativeGroup, NativeLayer, resolve_plan
from hybridcache.models.core.base import HybridLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer
from hybridcache.tools.report import render_plan

D, HEADS, HEAD_DIM, VOCAB = 16, 2, 8, 50
F64 = {"recurrent": {"state_dtype": torch.float64}}


def mamba2_mixer():
    return Mamba2Mixer(D, num_heads=4, head_dim=8, state_size=4, n_groups=1, conv_kernel=3, chunk_size=4)


def attention():
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)))
    return AttentionMixer(D, HEADS, 1, HEAD_DIM, rotary=rotary)


class TinyLM(HybridLM):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__({"vocab_size": VOCAB})
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = layers
        self.norm, self.lm_head = RMSNorm(D), nn.Linear(D, VOCAB, bias=False)
        torch.manual_seed(0)
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)

    @property
    def decoder_layers(self):
        return self.layers

    def embed(self, ids):
        return self.embed_tokens(ids)

    def head(self, h):
        return self.lm_head(self.norm(h))

    def native_layers(self):
        return [layer.native(self.dtype) for layer in self.layers]


def attn_native(dtype):
    return NativeLayer("full", {"num_kv_heads": 1, "head_dim": HEAD_DIM, "dtype": dtype})


def mamba_native(dtype):
    return NativeLayer(
        "mamba2", {"num_heads": 4, "head_dim": 8, "state_size": 4, "n_groups": 1, "conv_kernel": 3, "dtype": dtype}
    )


class ParallelLayer(nn.Module):
    """FalconH1-style: h + attention(x) + mamba(x), x = norm(h), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.mamba = RMSNorm(D), attention(), mamba2_mixer()
        self.ff_norm, self.mlp = RMSNorm(D), GatedMLP(D, 32)

    def native(self, dtype):
        return NativeGroup({"attention": attn_native(dtype), "mamba": mamba_native(dtype)})

    def forward(self, h, group: CacheGroup, step):
        x = self.norm(h)
        h = h + self.attn(x, group.attention, step) + self.mamba(x, group["mamba"], step)
        return h + self.mlp(self.ff_norm(h))


class SharedAttentionLayer(nn.Module):
    """Zamba2-style: every `shared`-using layer runs the SAME attention module (its own KV cache), then Mamba2."""

    def __init__(self, shared: nn.Module | None) -> None:
        super().__init__()
        self.shared, self.norm, self.mamba = shared, RMSNorm(D), mamba2_mixer()

    def native(self, dtype):
        if self.shared is None:
            return mamba_native(dtype)
        return NativeGroup({"attention": attn_native(dtype), "mamba": mamba_native(dtype)})

    def forward(self, h, entry, step):
        if self.shared is not None:
            h = h + self.shared(self.norm(h), entry.attention, step)
            entry = entry.mamba
        return h + self.mamba(self.norm(h), entry, step)


def falcon_like():
    return TinyLM(nn.ModuleList(ParallelLayer() for _ in range(3))).double().eval()


def zamba_like():
    shared = attention()
    return (
        TinyLM(
            nn.ModuleList(
                [
                    SharedAttentionLayer(None),
                    SharedAttentionLayer(shared),
                    SharedAttentionLayer(None),
                    SharedAttentionLayer(shared),
                ]
            )
        )
        .double()
        .eval()
    )


MODELS = {"falcon_like": falcon_like, "zamba_like": zamba_like}
STRATEGIES = {
    "native": {},
    "sliding": {"attention": {"type": "sliding", "window": 3}},
    "per-member": {"layers": {"1.attention": {"type": "chunked", "chunk_size": 4}}},
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def test_forward_block_is_the_base_one(model):
    assert type(model).forward_block is HybridLM.forward_block and type(model).forward is HybridLM.forward


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_cached_generation_equals_the_oracle(model, strategy):
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    config = {**STRATEGIES[strategy], **F64}
    cached = hc.generate(model, ids, attention_mask=mask, max_new_tokens=8, cache_config=config)
    oracle = hc.generate(model, ids, attention_mask=mask, max_new_tokens=8, cache_config=config, use_cache=False)
    assert torch.equal(cached.sequences, oracle.sequences)
    assert (cached.logits - oracle.logits).abs().max().item() < 1e-9
    chunked = hc.generate(model, ids, attention_mask=mask, max_new_tokens=8, cache_config=config, prefill_chunk_size=3)
    assert (chunked.logits - oracle.logits).abs().max().item() < 1e-9
    alone = hc.generate(model, ids[1:, 4:], max_new_tokens=8, cache_config=config)  # padding is invisible
    assert (alone.logits[0] - cached.logits[1]).abs().max().item() < 1e-9


def test_shared_weights_have_separate_caches_per_use():
    model = zamba_like()
    assert model.layers[1].shared is model.layers[3].shared
    cache = model.make_cache(1)
    model(torch.randint(0, VOCAB, (1, 5)), cache)
    a, b = cache[1].attention, cache[3].attention
    assert a is not b and a.key_pos.shape[1] == b.key_pos.shape[1] == 5 and not torch.equal(a.keys, b.keys)


def test_plan_addresses_groups_by_layer_and_member():
    model = falcon_like()
    plan = resolve_plan(
        model.native_layers(),
        {"layers": {"1.attention": {"type": "sliding", "window": 4}, 2: {"mamba": {"state_dtype": torch.float64}}}},
    )
    assert [p.address for p in plan.layers] == [
        "0.attention",
        "0.mamba",
        "1.attention",
        "1.mamba",
        "2.attention",
        "2.mamba",
    ]
    assert plan[2].type == "sliding" and plan[5].spec.state_dtype == torch.float64 and plan[0].type == "full"
    text = render_plan(plan)
    assert "member" in text and "attention" in text and "sliding" in text
    with pytest.raises(CacheConfigError, match="layer 1 is a group of attention, mamba; address a member"):
        resolve_plan(model.native_layers(), {"layers": {1: {"type": "sliding", "window": 4}}})
    with pytest.raises(CacheConfigError, match="group of attention, mamba"):
        resolve_plan(model.native_layers(), {"layers": {"1.conv": {"type": "conv"}}})
    with pytest.raises(CacheConfigError, match="not a group"):
        resolve_plan(zamba_like().native_layers(), {"layers": {"0.attention": {"type": "sliding", "window": 4}}})


def test_a_cache_with_another_structure_is_refused():
    falcon, zamba = falcon_like(), zamba_like()
    with pytest.raises(ValueError, match="needs a group of attention, mamba"):
        falcon(
            torch.randint(0, VOCAB, (1, 3)), zamba.make_cache(1).__class__.build([mamba_native(torch.float64)] * 3, 1)
        )

"""A pattern declares the form the decode kernels evaluate from positions (AttentionSpec.kernel_pattern): the built-in
ones declare theirs, a plugin pattern of one of those forms gets the fast paths by declaring it (no change under
hybridcache/ops), and a subclass that changes `visible` loses the form it inherited. What a spec declares must equal
its `visible`: checked here against the kernels' own rule (op_reference.visible, what the C kernel is tested to
compute) on every position pair, and end to end against the mask path on a model."""

from dataclasses import dataclass

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.native.op_reference import visible
from hybridcache.cache import AttentionCacheLayer, AttentionSpec, register_cache_layer, tunable
from hybridcache.cache.attention.specs import ChunkedSpec, FullSpec, SlidingSpec
from tests.models.conftest import prompts

ATTN = dict(num_kv_heads=1, head_dim=4)


@dataclass(frozen=True, kw_only=True)
class LocalSpec(AttentionSpec):
    """A plugin pattern: `span` tokens before the query and the query itself (RecurrentGemma's W + 1 convention),
    which is the kernels' sliding form with window span + 1."""

    span: int = tunable()

    def visible(self, q, kv):
        return (kv <= q) & (kv >= q - self.span)

    def needed_tokens(self, seen):
        return seen.clamp(max=self.span) if isinstance(seen, torch.Tensor) else min(seen, self.span)

    def kernel_pattern(self):
        return "sliding", self.span + 1


@register_cache_layer("local_span_test")
class LocalLayer(AttentionCacheLayer):
    spec_cls = LocalSpec
    example_params = {"span": 3}


@dataclass(frozen=True, kw_only=True)
class EvenOnlySpec(SlidingSpec):  # changes `visible`, inherits SlidingSpec's form: must not keep it
    def visible(self, q, kv):
        return super().visible(q, kv) & (kv % 2 == 0)


@pytest.mark.parametrize(
    "spec",
    [
        FullSpec(**ATTN),
        SlidingSpec(**ATTN, window=1),
        SlidingSpec(**ATTN, window=5),
        ChunkedSpec(**ATTN, chunk_size=1),
        ChunkedSpec(**ATTN, chunk_size=4),
        LocalSpec(**ATTN, span=3),
    ],
)
def test_a_declared_form_is_the_specs_visible(spec):
    q = torch.arange(-1, 40).view(-1, 1)  # every query position (-1: padding) against every key position
    kv = torch.arange(-1, 40).view(1, -1).expand(q.shape[0], -1)
    name, param = spec.kernel_pattern()
    want = (q >= 0) & (kv >= 0) & spec.visible(q.clamp(min=0), kv.clamp(min=0))
    assert torch.equal(visible(q, kv, name, param), want)


def test_a_spec_that_changes_visible_drops_the_form_it_inherited():
    assert SlidingSpec(**ATTN, window=4).kernel_pattern() == ("sliding", 4)
    assert EvenOnlySpec(**ATTN, window=4).kernel_pattern() is None


@pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")
def test_a_plugin_pattern_that_declares_its_form_gets_the_one_call_attention(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("gemma3"))
    ids = prompts(2, 6, seed=7)
    config = {"attention": {"type": "local_span_test", "span": 3}}
    served, real = [], AttentionAccel._reserve_with  # (the one-call attention, alone or in a many-layer call)

    def counted(self, *a):
        out = real(self, *a)
        served.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(AttentionAccel, "_reserve_with", counted)
        fast = hc.generate(model, ids, max_new_tokens=8, cache_config=config)  # 6 + 8 tokens: past the span
    assert served and all(served)
    with monkeypatch.context() as m:
        m.setattr(LocalSpec, "kernel_pattern", lambda self: None)  # undeclared: the mask path, no one-call step
        m.setattr(AttentionAccel, "_reserve_with", counted)
        served.clear()
        masked = hc.generate(model, ids, max_new_tokens=8, cache_config=config)
    assert served and not any(served)
    assert torch.equal(fast.sequences, masked.sequences)
    torch.testing.assert_close(fast.logits, masked.logits, rtol=0, atol=1e-5)  # two float32 summation orders

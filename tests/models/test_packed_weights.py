"""Fused projections and packed (bfloat16 / int8) weights: what they compute, against independent oracles."""

import pytest
import torch
from torch import nn

import hybridcache as hc
from hybridcache.nn.core.linear import DecodeLinear, PackedEmbedding, pack_matrix
from hybridcache.nn.core.linear_group import LinearGroup
from tests.models.conftest import prompts


def test_int8_rows_are_within_half_a_step_and_bfloat16_is_rounding():
    w = torch.randn(9, 33) * torch.logspace(-3, 2, 9)[:, None]
    w[4] = 0  # an all-zero row
    q, scale = pack_matrix(w, "int8")
    assert q.dtype == torch.int8 and scale.shape == (9,) and int(q.abs().max()) <= 127
    absmax = w.abs().amax(1)
    torch.testing.assert_close(scale[absmax > 0], absmax[absmax > 0] / 127)  # by hand: max|row| / 127
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7 * absmax[:, None]).all())
    assert bool((q[4] == 0).all())
    b, none = pack_matrix(w, "bfloat16")
    assert none is None and torch.equal(b, w.to(torch.bfloat16))


def test_a_group_is_one_matmul_with_the_same_parameters():
    lins = [nn.Linear(12, n, dtype=torch.float64) for n in (8, 4, 4)]
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    want = [lin(x) for lin in lins]
    names = {id(lin): lin.weight.shape for lin in lins}
    group = LinearGroup(*lins)
    assert group.fuse() and group.fused
    assert [lin.weight.shape for lin in lins] == list(names.values())  # shapes (and so state_dict) unchanged
    base = lins[0].weight.untyped_storage().data_ptr()
    assert all(lin.weight.untyped_storage().data_ptr() == base for lin in lins)  # one tensor, no copy kept
    for got, ref in zip(group(x), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # an in-place change of a parameter is a change of the fused matrix
        lins[1].weight.mul_(2)
    torch.testing.assert_close(group(x)[1], 2 * (want[1] - lins[1].bias) + lins[1].bias, rtol=0, atol=1e-12)
    lins[2].weight = nn.Parameter(torch.zeros(4, 12, dtype=torch.float64))  # replaced: never the stale matrix
    assert not group.fused
    torch.testing.assert_close(group(x)[2], lins[2].bias.expand(3, 5, 4))


def test_groups_that_cannot_fuse_say_so():
    assert not LinearGroup(nn.Linear(4, 2), nn.Linear(5, 2)).fuse()  # different inputs
    assert not LinearGroup(nn.Linear(4, 2), nn.Linear(4, 2, bias=False)).fuse()
    assert not LinearGroup(nn.Linear(4, 2), nn.Linear(4, 2, dtype=torch.float64)).fuse()


@pytest.mark.parametrize("family", ["gemma3", "jamba", "llama4"])
def test_models_are_fused_and_refused_after_to(models, checkpoints, family):
    model = hc.from_pretrained(checkpoints(family))
    groups = [g for m in model.modules() if hasattr(m, "projection_groups") for g in m.projection_groups()]
    assert groups and all(g.fused for g in groups)
    assert all(type(m) is not nn.Linear for m in model.modules())  # every projection is a DecodeLinear
    ids = prompts(2, 9, seed=3)
    before = model(ids).double()
    model.to(torch.float64)
    assert all(g.fused and g._fused[0].dtype == torch.float64 for g in groups)
    torch.testing.assert_close(model(ids), before, rtol=1e-4, atol=1e-4)


def _dequantized_copy(path, packed):
    """The unpacked model whose projection weights are the packed ones, widened to float32 by hand."""
    plain = hc.from_pretrained(path, decode_kernel=False)
    state = {}
    for name, module in packed.named_modules():
        if isinstance(module, (DecodeLinear, PackedEmbedding)):
            w = module.weight.float()
            scale = module._buffers.get("scale")
            state[f"{name}.weight"] = w * scale[:, None] if scale is not None else w
    missing = {k for k in state if k not in plain.state_dict()}
    assert not missing, missing
    with torch.no_grad():
        for name, value in state.items():
            plain.get_parameter(name).copy_(value)
    return plain


@pytest.mark.parametrize("family", ["gemma3", "jamba", "zamba2", "falcon_h1", "qwen3_next"])
def test_every_packed_matrix_is_the_original_rounded(checkpoints, family):
    """Against the unpacked model's own weights: int8 rows within half a step, bfloat16 the rounded values. Every
    projection and embedding is packed once (fused groups too: a second packing would replace their scales)."""
    plain = dict(hc.from_pretrained(checkpoints(family)).named_modules())
    heads = {id(m.weight) for m in plain.values() if isinstance(m, nn.Linear)}
    untied = {name for name, m in plain.items() if isinstance(m, nn.Embedding) and id(m.weight) not in heads}
    for fmt in ("int8", "bfloat16"):
        packed = hc.from_pretrained(checkpoints(family), weights=fmt)
        seen = 0
        for name, m in packed.named_modules():
            if not isinstance(m, (nn.Linear, nn.Embedding)):
                continue
            ref = plain[name].weight
            if name in untied:  # an untied embedding stays as it is (a step reads only B of its rows)
                assert torch.equal(m.weight, ref), name
                seen += 1
                continue
            if fmt == "bfloat16":
                assert m.weight.dtype == torch.bfloat16 and torch.equal(m.weight, ref.to(torch.bfloat16)), name
            else:
                scale = m._buffers.get("scale")
                assert m.weight.dtype == torch.int8 and scale is not None, name
                torch.testing.assert_close(scale, ref.abs().amax(1).clamp(min=1e-30) / 127, rtol=1e-6, atol=0)
                err = (m.weight.float() * scale[:, None] - ref).abs()
                assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all()), name
            seen += 1
        assert seen == sum(isinstance(m, (nn.Linear, nn.Embedding)) for m in plain.values())


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("family", ["gemma3", "jamba", "mamba2", "falcon_h1"])
def test_packed_model_equals_the_model_with_those_weights(checkpoints, family, fmt):
    path = checkpoints(family)
    packed = hc.from_pretrained(path, weights=fmt)
    assert packed.dtype == torch.float32
    reference = _dequantized_copy(path, packed)
    ids, mask = prompts(2, 13, seed=5), torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0
    got = hc.generate(packed, ids, mask, max_new_tokens=6)
    want = hc.generate(reference, ids, mask, max_new_tokens=6)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)


def test_a_tied_head_and_its_embedding_share_the_packed_matrix(checkpoints):
    packed = hc.from_pretrained(checkpoints("zamba2"), weights="int8")  # the tiny zamba2 ties its head
    emb, head = packed.model.embed_tokens, packed.lm_head
    assert isinstance(emb, PackedEmbedding) and emb.weight is head.weight and emb.weight.dtype == torch.int8
    assert emb.scale is head.scale
    # no float32 copy of any projection or of the tied matrix is kept
    assert all(m.weight.dtype == torch.int8 for m in packed.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    ids = prompts(1, 4, seed=1)
    torch.testing.assert_close(emb(ids), head.weight[ids].float() * head.scale[ids][..., None])


def test_bad_weight_formats_are_refused(checkpoints):
    with pytest.raises(ValueError, match="weights must be None or one of bfloat16, int8"):
        hc.from_pretrained(checkpoints("gemma3"), weights="int4")
    with pytest.raises(ValueError, match="float32"):
        hc.from_pretrained(checkpoints("gemma3"), weights="int8", dtype=torch.float64)


@pytest.mark.parametrize("weights", [None, "bfloat16", "int8"])
def test_gemma3_decode_with_the_fused_layer_tail_is_the_separate_calls(checkpoints, monkeypatch, weights):
    """Gemma 3 runs everything after attention in one kernel call (accel/layers/decoder_tail.py; a decode step runs it
    inside its whole-layer call, tests/models/test_attention_step.py): the same tokens and bit-identical logits as
    the separate calls, at every weight format, with left padding."""
    from hybridcache.accel import kernel_status
    from hybridcache.accel.layers import sandwich as sandwich_layer
    from hybridcache.accel.mixers.attention import AttentionAccel

    if not kernel_status().startswith("C kernels"):
        pytest.skip("the C kernels are not built")
    model = hc.from_pretrained(checkpoints("gemma3"), weights=weights)
    ids, mask = prompts(2, 7, seed=5), torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    calls = []
    real = sandwich_layer.decoder_tail
    monkeypatch.setattr(sandwich_layer, "decoder_tail", lambda *a: calls.append(real(*a)) or calls[-1])
    fused = hc.generate(model, ids, attention_mask=mask, max_new_tokens=5)
    assert calls and all(out is not None for out in calls)  # every layer of the prompt's block took the kernel
    monkeypatch.setattr(sandwich_layer, "decoder_tail", lambda *a: None)
    monkeypatch.setattr(AttentionAccel, "_reserve_with", lambda self, *a: None)  # decode: separate too
    separate = hc.generate(model, ids, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(fused.sequences, separate.sequences)
    assert torch.equal(fused.logits, separate.logits)

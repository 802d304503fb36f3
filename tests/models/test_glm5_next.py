"""GLM-5-Next specifics: the DSA indexer's choice of keys against HF's own indexer (top-k token indices), on a
left-padded batch, and the config paths (composite checkpoint, shared-layer placement). Logit parity, splits,
padding and continuation are in the FAMILIES-parametrized suites (test_parity.py)."""

import json

import pytest
import torch

from hybridcache.models.core.family_config import ConfigError
from hybridcache.models.families.glm5_next_config import Glm5NextCompositeConfig, Glm5NextConfig
from hybridcache.nn.attention.dsa import selection_mask
from tests.models.conftest import prompts


def _capture(module, into: list):
    return module.register_forward_hook(lambda m, args, out: into.append(out))


@torch.no_grad()
def test_indexer_selects_the_keys_hf_selects(models):
    ours, ref = models("glm5_next")
    ids = prompts(2, 21, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding: HF's pools start at the first real token, ours at position 0
    hf_out, our_out = [], []
    hooks = [
        _capture(ref.model.language_model.layers[1].self_attn.indexer, hf_out),
        _capture(ours.model.layers[1].self_attn.indexer, our_out),
    ]
    try:
        ref(ids, attention_mask=mask)
        ours(ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    topk = hf_out[0].long()  # [B, T, K] column indices, -1 = none
    b, t = ids.shape
    hf_sel = torch.zeros(b, t, t + 1, dtype=torch.bool).scatter_(2, topk.clamp(min=-1) % (t + 1), True)[..., :t]
    positions = torch.where(mask.bool(), mask.cumsum(1) - 1, -1)  # [B, T] column -> position (-1: padding)
    causal = (positions[:, :, None] >= positions[:, None, :]) & (positions[:, None, :] >= 0)
    real = mask.bool()[:, :, None] & causal
    ours_sel = selection_mask(our_out[0], positions) & real
    assert torch.equal(ours_sel, hf_sel & real)
    assert int(ours_sel.sum()) < int(real.sum()) * 0.7  # the indexer really drops keys at this length


def test_composite_config_reads_text_config(checkpoints):
    raw = json.loads((checkpoints("glm5_next") / "config.json").read_text())
    assert raw["model_type"] == "glm5_next"
    composite, text = Glm5NextCompositeConfig.from_hf(raw), Glm5NextConfig.from_hf(raw["text_config"])
    assert composite.kinds == text.kinds == ["linear_attention", "full", "shared", "linear_attention"]
    assert (composite.hc_mult, composite.index_kpool, composite.hidden_size) == (3, 2, 64)


def test_shared_layer_needs_an_indexed_layer_before_it(checkpoints):
    raw = json.loads((checkpoints("glm5_next") / "config.json").read_text())["text_config"]
    raw["indexer_types"] = ["full", "shared", "shared", "full"]  # layer 1 shares, but layer 0 is linear attention
    with pytest.raises(ConfigError, match="layer 1 shares top-k pools"):
        Glm5NextConfig.from_hf(raw)


@torch.no_grad()
def test_text_only_checkpoint_loads_the_same_model(checkpoints, models, tmp_path):
    """A glm5_next_text checkpoint (text config at the top, weights under model.*) gives the composite's logits."""
    from safetensors.torch import load_file, save_file

    import hybridcache as hc

    src = checkpoints("glm5_next")
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw["text_config"], "architectures": ["Glm5NextTextModel"]}))
    state = load_file(src / "model.safetensors")
    text = {k.replace("model.language_model.", "model."): v for k, v in state.items() if "visual" not in k}
    save_file(text, tmp_path / "model.safetensors")
    flat = hc.from_pretrained(tmp_path, dtype=torch.float32)
    ours, _ = models("glm5_next")
    assert type(flat).family == "glm5_next_text"
    ids = prompts(2, 9, seed=4)
    assert torch.equal(flat(ids), ours(ids))

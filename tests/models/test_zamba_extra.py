"""Zamba (v1) beyond the parity suite: HF's default layer plan, the one shared block stored once (each use with its
own KV cache), and the multi-head Mamba mixer's decode step against its own scan."""

import pytest
import torch
import transformers

from hybridcache.models.families.zamba import ZambaConfig, ZambaMambaMixer
from tests.models.conftest import prompts


@pytest.mark.parametrize("layers,period,offset", [(76, 6, 4), (13, 3, 1), (4, 6, 4)])
def test_default_plan_is_hfs(layers, period, offset):
    hf = transformers.ZambaConfig(num_hidden_layers=layers, attn_layer_period=period, attn_layer_offset=offset)
    raw = {k: v for k, v in hf.to_dict().items() if k not in ("layers_block_type", "layer_types")}
    assert ZambaConfig.from_hf(raw).block_types == list(hf.layers_block_type)


def test_the_shared_block_is_stored_once_with_a_kv_cache_per_use(models):
    ours, _ = models("zamba")
    layers = ours.model.layers
    assert layers[3]._shared[0] is layers[1].shared_transf
    assert not any(n.startswith("model.layers.3.shared_transf") for n in ours.state_dict())
    cache = ours.make_cache(1)
    ours(prompts(1, 5, seed=0), cache)
    a, b = cache[1].attention, cache[3].attention
    assert a is not b and not torch.equal(a.keys, b.keys)


def test_per_head_step_equals_scan():
    """The decode step (selective_state_update per head) continues the scan's state exactly as the scan would."""
    torch.manual_seed(0)
    cfg = ZambaConfig.from_hf(dict(vocab_size=8, hidden_size=32, num_hidden_layers=3, n_mamba_heads=4))
    mixer = ZambaMambaMixer(cfg)
    with torch.no_grad():
        mixer.x_proj_weight.normal_(0, 0.3)
        mixer.dt_proj_weight.normal_(0, 0.3)
        mixer.A_log.add_(torch.randn_like(mixer.A_log) * 0.1)
    b, t, di, n = 2, 6, cfg.mamba_intermediate, cfg.mamba_d_state
    u, z, delta = torch.randn(b, t, di), torch.randn(b, t, di), torch.randn(b, t, di) * 0.5
    bc, cc = torch.randn(b, t, cfg.n_mamba_heads, n), torch.randn(b, t, cfg.n_mamba_heads, n)
    a = -torch.exp(mixer.A_log.float())
    s0 = torch.randn(b, di, n) * 0.1
    y_scan, s_scan = mixer._scan(u, delta, a, bc, cc, z, s0)
    s, ys = s0, []
    for i in range(t):
        y, s = mixer._step(s, u[:, i], delta[:, i], a, bc[:, i], cc[:, i], z[:, i])
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_scan, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_scan, atol=1e-5, rtol=1e-5)

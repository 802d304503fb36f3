"""GPT-OSS's routed experts of one token in one C call (accel/native/steps/moe.py, csrc/moe_step.c) against the
reference module's own `GptOssExperts.expert` (HF's fused layout, the clamped swiglu) on random weights: the slots'
weighted sum, float32 noise (the kernel streams the input-major weights row by row; torch runs a matmul). Hostile
sizes and expert indices out of range are refused by name before any C call; float64 is left to the reference."""

import pytest
import torch

from hybridcache.accel import kernel_status
from hybridcache.accel.native.checks import KernelArgumentError
from hybridcache.accel.native.steps.moe import oss_experts_step
from hybridcache.models.families.gpt_oss import GptOssConfig, GptOssExperts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def _experts(e=6, d=24, i=20, seed=0) -> GptOssExperts:
    cfg = GptOssConfig(hidden_size=d, intermediate_size=i, num_local_experts=e, vocab_size=32, num_hidden_layers=2)
    experts = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7)  # large enough that the clamps at `limit` bite
    return experts


@pytest.mark.parametrize("k,sizes", [(1, (6, 24, 20)), (2, (6, 24, 20)), (4, (6, 24, 20)), (3, (5, 72, 100))])
def test_oss_experts_step_matches_the_reference_experts(k, sizes):
    e, d, _ = sizes  # (the last: column blocks of 64 with a partial one, 200 and 72 wide)
    experts = _experts(*sizes, seed=k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, d, generator=g) * 2
    index = torch.randperm(e, generator=g)[:k][None]  # [1, k]
    weights = torch.softmax(torch.randn(1, k, generator=g), dim=-1)
    with torch.no_grad():
        y = oss_experts_step(
            x, index, weights, experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
            experts.down_proj_bias, experts.alpha, experts.limit,
        )  # fmt: skip
        ref = sum(experts.expert(x, int(e)) * weights[:, s, None] for s, e in enumerate(index[0].tolist()))
    gate_up = x @ experts.gate_up_proj[index[0]] + experts.gate_up_proj_bias[index[0]]  # [k, 1, 2I]
    assert (gate_up.abs() > experts.limit).any()  # the clamps were exercised
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_oss_experts_step_refuses_hostile_input_by_name():
    ex = _experts()
    good = dict(
        x=torch.randn(1, 24), index=torch.tensor([[0, 5]]), weights=torch.tensor([[0.5, 0.5]]),
        gate_up=ex.gate_up_proj.detach(), gate_up_bias=ex.gate_up_proj_bias.detach(), down=ex.down_proj.detach(),
        down_bias=ex.down_proj_bias.detach(), alpha=1.702, limit=7.0,
    )  # fmt: skip
    with torch.no_grad():
        assert oss_experts_step(**good) is not None
        for change, match in [
            (dict(index=torch.tensor([[0, 6]])), "out of"),
            (dict(index=torch.tensor([[-1, 2]])), "out of"),
            (dict(index=torch.tensor([[0, 1]], dtype=torch.int32)), "int64"),
            (dict(weights=torch.ones(1, 3)), "weights"),
            (dict(down=torch.zeros(6, 20, 23)), "down"),
            (dict(gate_up=torch.zeros(6, 24, 39)), "gate_up"),
            (dict(down_bias=torch.zeros(6, 23)), "biases"),
            (dict(limit="7"), "real"),
        ]:
            with pytest.raises(KernelArgumentError, match=match):
                oss_experts_step(**{**good, **change})
        assert oss_experts_step(**{**good, "x": good["x"].double()}) is None  # float64: the reference's
        assert oss_experts_step(**{**good, "x": torch.randn(2, 24)}) is None  # two tokens: the reference's

"""The one-call decode steps of the recurrent mixer variants (accel/mixers/delta.py, accel/mixers/recurrent.py:
native/steps/recurrent.py `delta_step`, `rglru_step`, `mamba_groups_step`) against the reference modules' own
`forward` on random weights and states: Qwen3.5's and OLMo-Hybrid's Gated DeltaNet, Kimi's KDA, Bailing's and
GLM-5-Next's KDA (bounded and softplus decay), RecurrentGemma's recurrent block (a row restarting at position 0 beside
one that does not) and Zamba's grouped Mamba1. The cache layer is a stand-in that records what the mixer hands it.
Tolerance: float32 noise (the kernels sum in another order than torch's einsum / matmul). Hostile sizes are refused
by name before any C call; what the kernels do not take (float64, a prefill block) is left to the reference."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybridcache.accel import kernel_status
from hybridcache.accel.install import accel_for
from hybridcache.accel.mixers.delta import DeltaAccel, bailing_accel, kda_accel
from hybridcache.accel.mixers.recurrent import Mamba2Accel, MambaGroupsAccel, RGLRUAccel, rglru_accel
from hybridcache.accel.native.checks import KernelArgumentError
from hybridcache.accel.native.steps.recurrent import delta_step, mamba_groups_step, rglru_step
from hybridcache.models.families.glm5_next import Glm5DeltaAttention
from hybridcache.models.families.olmo_hybrid import OlmoHybridConfig, OlmoHybridGatedDeltaNet
from hybridcache.models.families.qwen3_5 import Qwen35GatedDeltaNet
from hybridcache.models.families.zamba import ZambaConfig, ZambaMambaMixer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.recurrent.kda import BailingDeltaAttention, KimiDeltaAttention
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer
from hybridcache.nn.recurrent.rglru import RecurrentBlock

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # the kernels serve inference only (with autograd on they decline)
        yield


class _Layer:
    """A recurrent cache layer as the mixers see it: `states`, `update` (recorded), no trail."""

    states = None  # (declared on the class: the fast path checks the class for the protocol)

    def __init__(self, **states: torch.Tensor) -> None:
        self.states, self.new = states, None
        self.spec = SimpleNamespace(dtype=torch.float32, state_dtype=torch.float32)

    def update(self, valid=None, trail=None, **new: torch.Tensor) -> None:
        self.new = new

    def trail_length(self, tokens: int) -> int:
        return 0


def _step(positions: list[int]) -> StepInput:
    pos = torch.tensor(positions)[:, None]  # [B, 1]
    return StepInput(torch.ones_like(pos, dtype=torch.bool), pos, pos[:, 0] + 1, True)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        fan = p.shape[-1] if p.dim() >= 2 else 2
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan))


def _both(module, accel, h, states: dict, positions: list[int]):
    """(the reference forward's output and new states, the accel's), from the same states (never written)."""
    before = {k: v.clone() for k, v in states.items()}
    module.accel = None
    ref_layer = _Layer(**states)
    ref = module(h, ref_layer, _step(positions))
    fast_layer = _Layer(**states)
    y = accel(h, fast_layer, _step(positions))
    assert y is not None, "the one-call step declined"
    assert all(torch.equal(states[k], before[k]) for k in states)  # the old states are read, never written
    return (ref, ref_layer.new), (y, fast_layer.new)


def _delta_mixers():
    olmo = OlmoHybridConfig(
        hidden_size=24,
        num_attention_heads=2,
        num_hidden_layers=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        vocab_size=32,
    )
    safe = BailingDeltaAttention(24, 3, 8, 4, 1e-6)
    softplus = BailingDeltaAttention(24, 3, 8, 3, 1e-6, safe_gate=False)
    return {  # name -> (mixer, its conv width)
        "qwen3_5": (Qwen35GatedDeltaNet(24, 2, 4, 8, 6), 4),
        "olmo_hybrid": (OlmoHybridGatedDeltaNet(olmo), 4),
        "kda": (KimiDeltaAttention(24, 3, 8, 4, 1e-6), 4),
        "bailing_bounded": (safe, 4),
        "bailing_softplus": (softplus, 3),
        "glm5_bounded": (Glm5DeltaAttention(24, 3, 8, 4, 1e-6, -5.0), 4),
        "glm5_softplus": (Glm5DeltaAttention(24, 3, 8, 4, 1e-6, None), 4),
    }


@pytest.mark.parametrize(
    "name", ["qwen3_5", "olmo_hybrid", "kda", "bailing_bounded", "bailing_softplus", "glm5_bounded", "glm5_softplus"]
)
@pytest.mark.parametrize("batch", [1, 3])
def test_delta_step_matches_the_reference_module(name, batch):
    import hybridcache.models  # noqa: F401  (the model files register their mixers' forms)

    mixer, k = _delta_mixers()[name]
    _randomize(mixer, batch + len(name))
    fast = accel_for(mixer)
    assert isinstance(fast, DeltaAccel)
    g = torch.Generator().manual_seed(7)
    h = torch.randn(batch, 1, 24, generator=g)
    conv = torch.randn(batch, mixer.conv_dim, k - 1, generator=g)
    states = {"conv": conv, "recurrent": torch.randn(batch, mixer.hv, mixer.dk, mixer.dv, generator=g) * 0.3}
    (ref, ref_new), (y, new) = _both(mixer, fast, h, states, [5] * batch)
    torch.testing.assert_close(new["conv"], ref_new["conv"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["recurrent"], ref_new["recurrent"], **TOL)
    torch.testing.assert_close(y, ref, **TOL)


def test_the_delta_forms_go_only_to_their_own_classes():
    class Other(KimiDeltaAttention):  # a subclass may compute another step
        pass

    assert kda_accel(Other(24, 3, 8)) is None
    assert bailing_accel(KimiDeltaAttention(24, 3, 8)) is None
    assert rglru_accel(type("Block", (RecurrentBlock,), {})(16, 8, 2, 4)) is None


@pytest.mark.parametrize("batch,positions", [(1, [4]), (3, [0, 7, 2])])
def test_rglru_step_matches_the_reference_block(batch, positions):
    block = RecurrentBlock(16, 24, 3, 4)
    _randomize(block, batch)
    fast = accel_for(block)
    assert isinstance(fast, RGLRUAccel)
    g = torch.Generator().manual_seed(batch)
    h = torch.randn(batch, 1, 16, generator=g)
    states = {"conv": torch.randn(batch, 24, 3, generator=g), "lru": torch.randn(batch, 24, generator=g)}
    (ref, ref_new), (y, new) = _both(block, fast, h, states, positions)
    torch.testing.assert_close(new["conv"], ref_new["conv"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["lru"], ref_new["lru"], **TOL)
    torch.testing.assert_close(y, ref, **TOL)


@pytest.mark.parametrize("batch,heads", [(1, 2), (2, 4)])
def test_mamba_groups_step_matches_zambas_mixer(batch, heads):
    cfg = ZambaConfig(hidden_size=16, n_mamba_heads=heads, mamba_d_state=8, num_hidden_layers=2, vocab_size=32)
    mixer = ZambaMambaMixer(cfg)
    _randomize(mixer, heads)
    fast = accel_for(mixer)
    assert isinstance(fast, MambaGroupsAccel)
    g = torch.Generator().manual_seed(heads)
    di, k = mixer.intermediate, mixer.conv1d.kernel_size[0]
    h = torch.randn(batch, 1, 16, generator=g)
    states = {"conv": torch.randn(batch, di, k - 1, generator=g), "ssm": torch.randn(batch, di, 8, generator=g)}
    (ref, ref_new), (y, new) = _both(mixer, fast, h, states, [3] * batch)
    torch.testing.assert_close(new["conv"], ref_new["conv"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["ssm"], ref_new["ssm"], **TOL)
    torch.testing.assert_close(y, ref, **TOL)


def _delta_args(batch=1):
    hk, hv, dk, dv = 1, 2, 4, 4
    proj = lambda rows, src=None: (torch.randn(rows, 8 if src is None else 4), None, None, src)  # noqa: E731
    return dict(
        x=torch.randn(batch, 1, 8),
        heads=(hk, hv, dk, dv),
        projs=[proj(16), proj(8), proj(2), proj(4), proj(8, 3)],  # qkv, z, b, a low-rank pair (f_a, f_b)
        n_qkv=1,
        fields=(1, 2, 4),
        conv_ws=[torch.randn(16, 4)],
        conv_state=torch.zeros(batch, 16, 3),
        decay=("channel", torch.zeros(8), torch.zeros(2), 0.0),
        beta_scale=1.0,
        rec_state=torch.zeros(batch, 2, 4, 4),
        norm=("sigmoid", torch.ones(4), 1e-6),
        out_proj=(torch.randn(8, 8), None, None),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(heads=(2, 3, 4, 4)), "heads"),
        (dict(n_qkv=2), "conv channels"),
        (dict(fields=(1, 2, 3)), "z / b / a"),
        (dict(fields=(1, 2, 9)), "fields"),
        (dict(decay=("cosine", torch.zeros(8), torch.zeros(2), 0.0)), "decay"),
        (dict(conv_ws=[torch.randn(15, 4)]), "conv weight"),
        (dict(conv_ws=[torch.randn(16, 1)]), "width"),
        (dict(norm=("relu", torch.ones(4), 1e-6)), "gate"),
        (dict(conv_state=torch.zeros(1, 16, 2)), "conv state"),
        (dict(rec_state=torch.zeros(1, 2, 4, 5)), "recurrent state"),
        (dict(out_proj=(torch.randn(8, 7), None, None)), "out_proj"),
        (dict(projs=[(torch.randn(16, 8), None, None, 2)]), "earlier source"),
    ],
)
def test_delta_step_refuses_hostile_sizes_by_name(change, match):
    assert delta_step(**_delta_args()) is not None
    with pytest.raises(KernelArgumentError, match=match):
        delta_step(**{**_delta_args(), **change})


def test_rglru_and_mamba_groups_steps_refuse_hostile_sizes_by_name():
    x, proj = torch.randn(1, 1, 8), (torch.randn(12, 8), None, None)
    out = (torch.randn(8, 12), None, None)
    gates = (torch.zeros(3, 4, 4), torch.zeros(3, 4), torch.zeros(3, 4, 4), torch.zeros(3, 4))
    good = dict(
        x=x, heads=3, y_proj=proj, x_proj=proj, conv_w=torch.randn(12, 4), conv_b=None,
        conv_state=torch.zeros(1, 12, 3), gates=gates, recurrent_param=torch.zeros(12),
        positions=torch.tensor([[2]]), lru_state=torch.zeros(1, 12), out_proj=out,
    )  # fmt: skip
    assert rglru_step(**good) is not None
    for change, match in [
        (dict(heads=5), "heads"),
        (dict(gates=gates[:3]), "gates"),
        (dict(gates=(torch.zeros(3, 4, 5), *gates[1:])), "gate tensor"),
        (dict(positions=torch.tensor([2])), "positions"),
        (dict(lru_state=torch.zeros(1, 13)), "LRU state"),
        (dict(x_proj=(torch.randn(11, 8), None, None)), "linear_x"),
    ]:
        with pytest.raises(KernelArgumentError, match=match):
            rglru_step(**{**good, **change})
    zamba = dict(
        x=x, in_proj=(torch.randn(32, 8), None, None), conv_w=torch.randn(16, 4), conv_b=None,
        conv_state=torch.zeros(1, 16, 3), x_w=torch.randn(2, 10, 8), dt_w=torch.randn(2, 8, 2),
        dt_bias=torch.zeros(16), a_log=torch.zeros(16, 4), d_skip=None, ssm_state=torch.zeros(1, 16, 4),
        out_proj=(torch.randn(8, 16), None, None),
    )  # fmt: skip
    assert mamba_groups_step(**zamba) is not None
    for change, match in [
        (dict(x_w=torch.randn(2, 10)), "x_proj"),
        (dict(dt_w=torch.randn(2, 8, 3)), "dt_proj"),
        (dict(x_w=torch.randn(3, 10, 8), dt_w=torch.randn(3, 8, 2)), "x_proj"),
        (dict(conv_w=torch.randn(15, 4)), "conv weight"),
        (dict(ssm_state=torch.zeros(1, 16, 5)), "state"),
    ]:
        with pytest.raises(KernelArgumentError, match=match):
            mamba_groups_step(**{**zamba, **change})


def test_what_the_variant_kernels_do_not_take_goes_to_the_reference():
    args = _delta_args()
    assert delta_step(**{**args, "x": args["x"].double()}) is None  # float64
    assert delta_step(**{**args, "x": torch.randn(1, 3, 8)}) is None  # a prefill block
    assert delta_step(**{**args, "rec_state": args["rec_state"].double()}) is None  # a float64 state
    biased = [(w, torch.zeros(w.shape[0]), s, src) for w, _, s, src in args["projs"]]
    assert delta_step(**{**args, "projs": biased}) is None  # biased projections: not this kernel's
    block = RecurrentBlock(16, 24, 3, 4)
    fast = accel_for(block)
    layer = _Layer(conv=torch.zeros(2, 24, 3), lru=torch.zeros(2, 24))
    assert fast(torch.randn(2, 4, 16), layer, _step([1, 1])) is None  # a prefill (T = 4)
    assert fast(torch.randn(2, 1, 16).double(), layer, _step([1, 1])) is None
    block.conv_1d.register_forward_hook(lambda *a: None)
    assert fast(torch.randn(2, 1, 16), layer, _step([1, 1])) is None  # a hook inside: the reference runs it
    assert layer.new is None


def test_delta_accel_follows_weights_changed_or_replaced_after_its_first_call():
    """The accel checks the weights once and keeps their pointers: values changed in place are read, a replaced
    tensor (or a projection that gains a bias) makes it check again, so its output stays the reference's."""
    mixer = KimiDeltaAttention(24, 3, 8, 4, 1e-6)
    _randomize(mixer, 11)
    fast = accel_for(mixer)
    g = torch.Generator().manual_seed(11)
    h = torch.randn(2, 1, 24, generator=g)
    states = {"conv": torch.randn(2, mixer.conv_dim, 3, generator=g), "recurrent": torch.randn(2, 3, 8, 8) * 0.3}
    _both(mixer, fast, h, states, [4, 4])  # bound here
    mixer.q_proj.weight.mul_(-1.5)  # in place: the same memory
    (ref, _), (y, _) = _both(mixer, fast, h, states, [4, 4])
    torch.testing.assert_close(y, ref, **TOL)
    mixer.o_proj.weight = torch.nn.Parameter(torch.randn(24, 24, generator=g))  # replaced: other memory
    (ref, _), (y, _) = _both(mixer, fast, h, states, [4, 4])
    torch.testing.assert_close(y, ref, **TOL)
    mixer.b_proj.bias = torch.nn.Parameter(torch.ones(3))  # a bias the kernel does not take: the reference runs
    assert fast(h, _Layer(**states), _step([4, 4])) is None


def test_mamba2_accel_follows_weights_changed_or_replaced_after_its_first_call():
    """Mamba2's accel binds its weights once too (bind_mamba2_step): in-place changes are read, a replaced tensor
    rebinds, a different norm eps or gate is seen; its output stays the reference module's."""
    mixer = Mamba2Mixer(16, 4, 4, 8, n_groups=2)
    _randomize(mixer, 3)
    fast = accel_for(mixer)
    assert isinstance(fast, Mamba2Accel)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 1, 16, generator=g)
    states = {"conv": torch.randn(2, mixer.conv_dim, 3, generator=g), "ssm": torch.randn(2, 4, 4, 8, generator=g)}
    _both(mixer, fast, h, states, [2, 2])
    for change in (
        lambda: mixer.in_proj.weight.mul_(0.5),  # in place
        lambda: setattr(mixer.out_proj, "weight", torch.nn.Parameter(torch.randn(16, 16, generator=g))),
        lambda: setattr(mixer.norm, "eps", 0.5),
        lambda: setattr(mixer.norm, "norm_before_gate", True),
    ):
        change()
        (ref, ref_new), (y, new) = _both(mixer, fast, h, states, [2, 2])
        torch.testing.assert_close(new["ssm"], ref_new["ssm"], **TOL)
        torch.testing.assert_close(y, ref, **TOL)

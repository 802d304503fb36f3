"""A decode step's layers in one C call for the families whose recurrent mixers joined the layer program later: the
delta variants (Qwen3.5, OLMo-Hybrid's Gated DeltaNet, Kimi's and Bailing's KDA: hc_delta_step records) and
RecurrentGemma's RG-LRU block (hc_rglru_step records; its attention layers, whose gated MLP is a GatedMLP subclass,
as hc_decoder_layer records), each layer as its input norm, one-call mixer step and tail;
and Nemotron-H's blocks (the model offers the fast path its blocks, each with its run's cache entry): a Mamba2 block
is a pre-norm layer with no MLP branch, an MLP block one hc_pre_norm_mlp record (norm, up, squared ReLU, down, add);
LFM3's conv layers with sandwich norms (input norm, short conv step, hc_sandwich_tail).
The oracle is the per-layer path (`record_step` off: every layer its own module call, the mixers' one-call steps
still run): logits, tokens and every cache state must be bit-identical, and the tokens equal to HF transformers'.
Whatever the program does not take (MLA attention, a MoE MLP, OLMo's post-norm attention layers) runs as its module
call between programs."""

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.layers import pre_norm as pre_norm_layer
from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.mixers.recurrent import STEPS
from hybridcache.accel.native import layer_program
from tests.models.conftest import hf_generate, left_padded, prompts
from tests.models.test_pre_norm_records import _cache_state, _per_layer, _programs, _same_cache

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

# family -> the records its layers run as (besides norms and tails)
FAMILIES = {
    "qwen3_5": ("delta", "gated_decoder_layer"),  # (its attention layers gated: hc_gated_decoder_layer)
    "olmo_hybrid": ("delta",),
    "kimi_linear": ("delta",),
    "bailing_hybrid": ("delta",),
    "recurrentgemma": ("rglru", "decoder_layer"),
    "nemotron_h": ("mamba2", "pre_norm_mlp", "attention_layer"),  # (attention blocks: no MLP)
    "lfm3": (
        "short_conv",
        "sandwich_tail",
        "gated_decoder_layer",  # (its gated attention layers with sandwich norms)
    ),  # (its conv layers with sandwich norms)  # (Mamba2 blocks: pre-norm layers with no MLP; MLP blocks: no mixer)
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_program_is_the_per_layer_calls(checkpoints, monkeypatch, family):
    model = hc.from_pretrained(checkpoints(family))
    assert any(isinstance(b.__dict__.get("accel"), PreNormAccel) for b in model.modules())  # (or a subclass)
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
    for kind in FAMILIES[family]:  # (the mixers and MLP layers ran as records)
        assert sum(ops.count(layer_program.CODES[kind]) for ops in calls) > 0
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logits, want.logits)
    _same_cache(_cache_state(got.cache), _cache_state(want.cache))


@pytest.mark.parametrize("family", ["qwen3_5", "recurrentgemma", "nemotron_h", "lfm3"])
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
            # (one row: decode_runs=False keeps the steps on the records; the runs are test_program_run.py's)
            out = hc.generate(model, ids, max_new_tokens=6, cache_config=config, decode_runs=False)
            state = _cache_state(out.cache)
            out.cache.crop(out.cache.seq.seen.max().item() - 2)
            cropped = _cache_state(out.cache)
            more = hc.generate(model, out.sequences[:, :-2], max_new_tokens=4, cache=out.cache, decode_runs=False)
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


@pytest.mark.parametrize("family", ["qwen3_5", "recurrentgemma", "lfm3"])
def test_a_steady_generation_moves_the_kept_records(checkpoints, monkeypatch, family):
    """Inside one generate call a recurrent layer's records are kept and only its input, output and states move
    (RG-LRU's the step's positions too); a second generation on the same cache, where the states moved on, equals
    the per-layer path too."""
    model = hc.from_pretrained(checkpoints(family))
    ids = prompts(1, 5, seed=9)
    outs, moved = [], []
    real = pre_norm_layer._Kept.step

    def counted(self, *args):
        got = real(self, *args)
        moved.append(got is not None)
        return got

    for per_layer in (False, True):
        with monkeypatch.context() as m:
            m.setattr(pre_norm_layer._Kept, "step", counted)
            if per_layer:
                _per_layer(m)
            # (one row: decode_runs=False keeps the steps on the records; the runs are test_program_run.py's)
            first = hc.generate(model, ids, max_new_tokens=5, decode_runs=False)
            second = hc.generate(model, first.sequences, max_new_tokens=5, cache=first.cache, decode_runs=False)
            outs.append((first.logits, second.logits, _cache_state(second.cache)))
    assert any(moved)  # (the kept records ran)
    (a1, a2, ca), (b1, b2, cb) = outs
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    _same_cache(ca, cb)


def test_the_mlp_layer_record_refuses_what_it_does_not_take_and_computes_the_block():
    """hc_pre_norm_mlp's wrappers: what the kernel does not take is None (the module runs); the record computes
    h + down(relu(up(rms_norm(h) * scale))^2), checked against a float64 recompute."""
    g = torch.Generator().manual_seed(0)
    h, out = torch.randn(2, 1, 8, generator=g), torch.full((2, 1, 8), 7.0)
    scale, w_up, w_dn = torch.rand(8, generator=g) + 0.5, torch.randn(6, 8, generator=g), torch.randn(8, 6, generator=g)
    bias = torch.randn(6, generator=g)
    up, down = (w_up, bias, None), (w_dn, None, None)
    bound = layer_program.bind_mlp_layer(8, (scale, 1e-5), up, down, "relu2")
    assert bound is not None
    assert layer_program.bind_mlp_layer(8, (scale, 1e-5), up, down, "silu") is None  # not an activation it computes
    assert layer_program.bind_mlp_layer(8, (torch.ones(7), 1e-5), up, down, "relu2") is None  # a norm of another width
    assert layer_program.bind_mlp_layer(8, (scale, "eps"), up, down, "relu2") is None
    assert layer_program.bind_mlp_layer(8, (scale, 1e-5), (w_up.double(), None, None), down, "relu2") is None
    assert layer_program.bind_mlp_layer(8, (scale, 1e-5), up, (torch.randn(8, 5), None, None), "relu2") is None
    assert layer_program.bind_mlp_layer(8, (scale, 1e-5), (w_up, torch.ones(5), None), down, "relu2") is None
    assert layer_program.pre_norm_mlp_args(torch.randn(2, 1, 7), torch.empty(2, 1, 7), bound) is None  # another width
    assert layer_program.pre_norm_mlp_args(torch.randn(1, 2, 8), torch.empty(1, 2, 8), bound) is None  # 2 tokens
    assert layer_program.pre_norm_mlp_args(h.double(), out.double(), bound) is None
    args, scratch = layer_program.pre_norm_mlp_args(h, out, bound)
    assert torch.equal(out, torch.full((2, 1, 8), 7.0))  # (nothing run yet)
    layer_program.call_program([(layer_program.CODES["pre_norm_mlp"], args)])
    x = h.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * scale.double()
    want = h.double() + torch.relu(x @ w_up.double().T + bias.double()).square() @ w_dn.double().T
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5)


class _States:
    """A recurrent cache layer as the one-call steps see it (accel/slots.py StateSlots), holding given states."""

    def __init__(self, states: dict) -> None:
        self._states = states

    @property
    def states(self) -> dict:
        return self._states

    def update(self, valid=None, trail=None, **new_states) -> None:
        self._states = new_states

    def trail_length(self, tokens: int) -> int:
        return 0


class _Step:
    all_real = True

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions


@pytest.mark.parametrize(
    ("family", "kind"), [("zamba", "mamba_groups"), ("recurrentgemma", "rglru"), ("qwen3_5", "delta")]
)
def test_a_mixer_record_is_its_one_call_step(checkpoints, family, kind):
    """Each mixer's record run by hc_layer_program gives its one-call step's bits (output and new states), from
    random states and input (Zamba's grouped Mamba1 has no layer shape that records yet: this is its record's test)."""
    model = hc.from_pretrained(checkpoints(family))
    fast = next(m.accel for m in model.modules() if "accel" in m.__dict__ and getattr(m.accel, "prepare", None))
    g = torch.Generator().manual_seed(1)
    cache = model.make_cache(2)
    layer = next(c for c in cache.layers if c.kind == "recurrent")
    states = {name: torch.randn(t.shape, generator=g) for name, t in layer.states.items()}  # [2, ...] each
    h, step = torch.randn(2, 1, model.cfg.hidden_size, generator=g), _Step(torch.tensor([[4], [0]]))
    with torch.no_grad():  # (an inference step: the one-call steps decline under autograd)
        got = fast.prepare(h, _States(states), step)
        assert got is not None and got[0] == kind
        _, args, names = got
        want = STEPS[kind][0](*args)  # the one-call step
        c_args, outs, _alive = STEPS[kind][1](*args)
        layer_program.call_program([(layer_program.CODES[kind], c_args)])
    assert len(outs) == len(want) == len(names) + 1
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


def test_the_attention_record_without_an_mlp_declines_what_it_does_not_take(checkpoints):
    """Nemotron-H's attention blocks bind hc_attention_layer's tail; another width or a projection the kernel does
    not compute binds nothing (the block then runs as its module call)."""
    from hybridcache.accel.kernel_memo import KernelMemo
    from hybridcache.accel.layers.decoder_tail import bound_attention_tail

    model = hc.from_pretrained(checkpoints("nemotron_h"))
    attn = next(b for b in model.backbone.layers if b.kind == "full_attention").mixer
    d, width = model.cfg.hidden_size, attn.num_heads * attn.head_dim
    tail = bound_attention_tail(d, width, attn.o_proj, None, KernelMemo())
    assert tail is not None and tail.layer_fn == "hc_attention_layer" and tail.dims == (d, width, d)
    assert bound_attention_tail(d, width + 1, attn.o_proj, None, KernelMemo()) is None  # not o_proj's width
    assert bound_attention_tail(d, width, torch.nn.Linear(width, d), None, KernelMemo()) is None  # not a DecodeLinear
    assert bound_attention_tail(d, width, attn.o_proj, torch.nn.LayerNorm(d), KernelMemo()) is None  # not an RMSNorm


def test_a_sandwich_attention_whose_record_declines_after_reserving_runs_apart(checkpoints, monkeypatch):
    """LFM3's attention layers record as sandwich programs: when one layer's slot is reserved and then its record
    declines, that layer runs by its separate calls (SandwichProgramAccel.separate, writing the reserved slot)
    between programs. The same logits and cache as the per-layer calls."""
    from hybridcache.accel.layers.sandwich_program import SandwichProgramAccel
    from hybridcache.accel.mixers.attention import AttentionAccel

    model = hc.from_pretrained(checkpoints("lfm3"))
    attention = [b for b in model.decoder_layers if isinstance(b.__dict__.get("accel"), SandwichProgramAccel)]
    attention = [b for b in attention if isinstance(b.sandwich_parts().attn.__dict__.get("accel"), AttentionAccel)]
    assert attention, "LFM3's tiny checkpoint has no recording attention layer"
    declining = attention[0].sandwich_parts().attn
    ids, mask = left_padded(2, 7, seed=8)
    real, separated = AttentionAccel._reserve_with, []
    real_separate = SandwichProgramAccel.separate

    def reserve(self, *a):
        got = real(self, *a)
        if got is None or self.mixer is not declining:
            return got

        class Declines:  # the bound call, whose record declines (its own call is never reached here)
            record = staticmethod(lambda *a: None)

        return Declines, got[1], got[2]

    def separate(self, *a):
        separated.append(self)
        return real_separate(self, *a)

    with monkeypatch.context() as m:
        m.setattr(AttentionAccel, "_reserve_with", reserve)
        m.setattr(SandwichProgramAccel, "separate", separate)
        got = hc.generate(model, ids, attention_mask=mask, max_new_tokens=6, decode_runs=False)
    assert separated  # the declining layer ran by its separate calls
    with monkeypatch.context() as m:
        _per_layer(m)
        want = hc.generate(model, ids, attention_mask=mask, max_new_tokens=6, decode_runs=False)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logits, want.logits)
    _same_cache(_cache_state(got.cache), _cache_state(want.cache))

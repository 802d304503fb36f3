"""A decode step's pre-norm layers in one C call (accel/layers/pre_norm.py, accel/native/layer_program.py,
csrc/layer_program.c hc_layer_program): each recurrent layer's input norm, one-call mixer step and tail, and each
attention layer's hc_decoder_layer, run as records with the arguments the per-layer calls pass, in the same order.
So logits, tokens and every cache state (attention keys / values / positions, recurrent states and their
checkpoint trails) must be bit-identical to the per-layer one-call path (the oracle: `record_step` off), and the
tokens equal to HF transformers'; hooks split the program, a failure leaves the cache as it was."""

import ctypes

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.native import layer_program
from hybridcache.accel.runs import layer_records
from tests.models.conftest import hf_generate, left_padded, prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

# family -> whether every decoder layer records (False: MoE MLPs, which run as module calls between programs)
FAMILIES = {"lfm2": True, "bamba": True, "mamba": True, "mamba2": True, "jamba": False}
RECURRENT = {layer_program.CODES[k] for k in ("short_conv", "mamba2", "mamba", "gated_delta")}


def _programs(monkeypatch) -> list[list[int]]:
    """The op codes of each many-layer call (hc_layer_program's, or hc_decoder_stack's: whole attention layers)."""
    calls, real, real_records = [], layer_program.call_program, layer_records.call_records

    def counted(program):
        calls.append([op for op, _ in program])
        return real(program)

    def counted_records(records):
        calls.append([layer_program.CODES["decoder_layer"]] * len(records))
        return real_records(records)

    monkeypatch.setattr(layer_records, "call_program", counted)
    monkeypatch.setattr(layer_records, "call_records", counted_records)
    return calls


def _cache_state(cache) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's held tensors: a recurrent layer's states (trails included), an attention layer's keys, values
    and key positions; and the token counts."""
    out = [cache.seq.seen.clone()]
    for layer in cache.layers:
        if layer.kind == "recurrent":  # every held part (checkpoint trails included) and the trail's columns
            cols = getattr(layer, "trail_columns", None)
            out.append(tuple(getattr(layer, a).clone() for a in layer._parts) + (() if cols is None else (cols,)))
        else:
            out.append((layer.keys.clone(), layer.values.clone(), layer.key_pos.clone()))
    return out


def _same_cache(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))


def _per_layer(monkeypatch):
    """The oracle: every layer its own module call (the mixers' one-call steps still run)."""
    monkeypatch.setattr(layer_records, "record_step", lambda *a: None)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_program_is_the_per_layer_calls(checkpoints, monkeypatch, family):
    model = hc.from_pretrained(checkpoints(family))
    assert any(isinstance(b.__dict__.get("accel"), PreNormAccel) for b in model.decoder_layers)
    ids, mask = left_padded(2, 7, seed=5)
    new = 10
    with monkeypatch.context() as m:
        calls = _programs(m)
        got = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new)
    assert any(RECURRENT & set(ops) for ops in calls)  # recurrent layers ran as records
    if FAMILIES[family]:  # every decode step: all layers in one call
        assert len(calls) == new - 1
    with monkeypatch.context() as m:
        _per_layer(m)
        want = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logits, want.logits)
    _same_cache(_cache_state(got.cache), _cache_state(want.cache))


@pytest.mark.parametrize("family", list(FAMILIES))
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


def test_checkpoint_trails_and_crop_are_the_per_layer_ones(checkpoints, monkeypatch):
    """With recurrent rollback the cache keeps each step's states in its trail: the program hands the new states
    to the cache as the per-layer step does, so trails, a crop back into them and the steps after it are equal."""
    model = hc.from_pretrained(checkpoints("bamba"))
    ids, config = prompts(1, 6, seed=7), {"recurrent": {"rollback": 3}}
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, max_new_tokens=6, cache_config=config, decode_runs=False)  # (per step)
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


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
@pytest.mark.parametrize(
    "recurrent",
    [
        {"state_codec": "int8"},
        {"state_codec": "zero"},
        {"state_codec": "int4", "error_feedback": True, "error_codec": "bfloat16"},
    ],
)
def test_state_codecs_are_the_per_layer_ones(checkpoints, monkeypatch, family, recurrent):
    """A state codec hands the step states it decodes into fresh tensors (held by nothing but the step's arguments
    until the program runs) and re-encodes the new ones: the program must read and hand over exactly what the
    per-layer step does (a use-after-free here once gave garbage logits, KL ~2 nats, with int8 states)."""
    model = hc.from_pretrained(checkpoints(family))
    ids, mask = left_padded(2, 7, seed=11)
    config = {"recurrent": recurrent}
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=8, cache_config=config)
            outs.append((out.sequences, out.logits, _cache_state(out.cache), len(calls)))
    (sa, la, ca, na), (sb, lb, cb, nb) = outs
    assert na > 0 and nb == 0  # the programs ran, then the per-layer path
    assert torch.equal(sa, sb) and torch.equal(la, lb)
    _same_cache(ca, cb)


def test_a_hooked_layer_splits_the_program_and_its_hook_runs(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("lfm2"))
    seen = []
    handle = model.decoder_layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    ids, new = prompts(1, 5, seed=1), 6
    try:
        with monkeypatch.context() as m:
            calls = _programs(m)
            got = hc.generate(model, ids, max_new_tokens=new)
        with monkeypatch.context() as m:
            _per_layer(m)
            want = hc.generate(model, ids, max_new_tokens=new)
    finally:
        handle.remove()
    assert len(seen) == 2 * new  # the prefill and every decode step, in both generations
    assert len(calls) == 2 * (new - 1)  # each decode step: layer 0, then the layers after the hooked one
    assert torch.equal(got.logits, want.logits)


def test_a_failed_call_leaves_the_cache_as_it_was(checkpoints, monkeypatch):
    """The C call ran some records (a layer's new states written), then failed: the block is aborted, the cache
    holds what it held (no state was handed to it), and the next steps equal a fresh run."""
    model = hc.from_pretrained(checkpoints("bamba"))
    ids = prompts(1, 5, seed=2)
    out = hc.generate(model, ids, max_new_tokens=2)
    before = _cache_state(out.cache)
    real = layer_program.call_program

    def fails(program):
        real(program[:4])  # the first layer ran (its new states written into fresh tensors)
        raise MemoryError("hc_layer_program: record 4 failed")

    with monkeypatch.context() as m, pytest.raises(MemoryError, match="record 4"):
        m.setattr(layer_records, "call_program", fails)
        hc.generate(model, out.sequences, max_new_tokens=1, cache=out.cache, decode_runs=False)  # (not a run's)
    _same_cache(_cache_state(out.cache), before)
    again = hc.generate(model, out.sequences, max_new_tokens=3, cache=out.cache).logits
    fresh = hc.generate(model, ids, max_new_tokens=5).logits
    assert torch.equal(again, fresh[:, 2:])


def test_a_library_whose_records_are_not_the_declared_ones_is_not_called(checkpoints, monkeypatch):
    """The library states each record's field types; other than the declared ones, the recurrent layers run as
    module calls (the same numbers)."""
    model = hc.from_pretrained(checkpoints("mamba2"))
    ids = prompts(1, 5, seed=4)
    want = hc.generate(model, ids, max_new_tokens=4)
    lib = layer_program._library()
    real = lib.hc_op_record_codes

    class Lying:
        def __getattr__(self, name):
            return getattr(lib, name)

        def hc_op_record_codes(self, op):
            return real(op).replace(b"F", b"I")

    with monkeypatch.context() as m:
        m.setattr(layer_program, "_library", lambda: Lying())
        m.setattr(layer_program, "_state", {})
        calls = _programs(m)
        got = hc.generate(model, ids, max_new_tokens=4)
    assert calls == []
    assert torch.equal(got.logits, want.logits)
    assert isinstance(ctypes.sizeof(layer_program.record_types()[0]), int)  # (the real library's layouts again)


def test_a_module_call_between_programs_is_the_per_layer_one(checkpoints, monkeypatch):
    """A preallocated cache's attention layer does not reserve a slot: it runs as its module call between two
    programs, and the layer after it reads its output (kept alive until the program runs)."""
    model = hc.from_pretrained(checkpoints("bamba"))
    ids, new = prompts(2, 21, seed=6), 10
    outs = []
    for per_layer in (False, True):
        with monkeypatch.context() as m:
            if per_layer:
                _per_layer(m)
            calls = _programs(m)
            out = hc.generate(model, ids, max_new_tokens=new, cache=model.make_cache(2, max_length=40))
            outs.append((out, calls))
    (got, calls), (want, none) = outs
    assert none == [] and len(calls) == 2 * (new - 1)  # the layers before the attention layer, then those after it
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)
    _same_cache(_cache_state(got.cache), _cache_state(want.cache))


def test_the_program_wrappers_refuse_what_they_do_not_take():
    """Nothing reaches hc_layer_program unchecked: arguments the kernels do not take are None (the module runs), a
    record of another op's layout or an unknown op is a named error before any C call."""
    x, out = torch.randn(1, 1, 8), torch.full((1, 1, 8), 7.0)
    scale = torch.ones(8)
    assert layer_program.rms_norm_args(x, scale, 1e-5, out) is not None
    assert layer_program.rms_norm_args(x, torch.ones(7), 1e-5, out) is None  # a scale of another width
    assert layer_program.rms_norm_args(x.double(), scale, 1e-5, out) is None  # float64
    assert layer_program.rms_norm_args(x, scale, "eps", out) is None
    assert layer_program.rms_norm_args(torch.randn(1, 2, 8), scale, 1e-5, torch.empty(1, 2, 8)) is None  # 2 tokens
    w_gu, w_dn = torch.randn(6, 8), torch.randn(8, 3)
    bound = layer_program.bind_tail(8, (scale, 1e-5), (w_gu, None, None), (w_dn, None, None), "silu")
    assert bound is not None
    assert (
        layer_program.bind_tail(8, (scale, 1e-5), (torch.randn(5, 8), None, None), (w_dn, None, None), "silu") is None
    )
    assert layer_program.bind_tail(8, (scale, 1e-5), (w_gu, None, None), (w_dn, None, None), "relu2") is None
    assert layer_program.bind_tail(8, (torch.ones(7), 1e-5), (w_gu, None, None), (w_dn, None, None), "silu") is None
    assert layer_program.pre_norm_tail_args(x, torch.randn(1, 1, 7), out, bound) is None
    assert layer_program.pre_norm_tail_args(x, x, out, bound) is not None
    norm = layer_program.rms_norm_args(x, scale, 1e-5, out)
    other = layer_program.record_types()[layer_program.CODES["pre_norm_tail"]]
    with pytest.raises(layer_program.ProgramError, match="another op"):
        layer_program.call_program([(layer_program.CODES["rms_norm"], other())])
    with pytest.raises(layer_program.ProgramError, match="op code"):
        layer_program.call_program([(99, norm)])
    with pytest.raises(layer_program.ProgramError):  # a bad record anywhere: nothing of the program runs
        layer_program.call_program([(layer_program.CODES["rms_norm"], norm), (99, norm)])
    assert torch.equal(out, torch.full((1, 1, 8), 7.0))
    layer_program.call_program([(layer_program.CODES["rms_norm"], norm)])  # (and the good record alone runs)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), rtol=1e-6, atol=1e-6)


def test_an_mlp_whose_forward_is_its_own_runs_as_its_module(checkpoints, monkeypatch):
    """A GatedMLP subclass that defines its own forward computes something else than the fused kernel: the program
    must not take it (GatedMLP.computes_gated_mlp, set at class creation), so the model decodes as the per-layer
    module calls, which run that forward, and not as the plain MLP would."""
    from hybridcache.nn.core.mlp import GatedMLP

    class Shifted(GatedMLP):
        def forward(self, x):
            return super().forward(x) + 0.25

    class Inherits(Shifted):  # no forward of its own, but its parent's is not GatedMLP's
        pass

    assert GatedMLP.computes_gated_mlp and not Shifted.computes_gated_mlp and not Inherits.computes_gated_mlp
    model = hc.from_pretrained(checkpoints("lfm2"))
    ids = prompts(1, 6, seed=2)
    plain = hc.generate(model, ids, max_new_tokens=6)
    mlps = [m for m in model.modules() if type(m) is GatedMLP]
    assert mlps
    for m in mlps:
        m.__class__ = Inherits
    got = hc.generate(model, ids, max_new_tokens=6)
    with monkeypatch.context() as m:
        _per_layer(m)
        want = hc.generate(model, ids, max_new_tokens=6)
    assert torch.equal(got.logits, want.logits)
    assert not torch.equal(got.logits, plain.logits)  # the override changes the numbers

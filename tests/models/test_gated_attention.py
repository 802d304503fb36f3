"""A gated attention's decode step in one kernel call (Qwen3.5's: q_proj yields per head [query | gate], the output
times sigmoid(gate) before o_proj; csrc/fused_layer.c hc_gated_attention_step, and hc_gated_decoder_layer as a record
of the layer program and of Qwen3.5's decode runs and greedy C loop).

The gate's sigmoid in C is not torch's to the bit, so the oracle is the reference modules within float32 noise (the
one-call step declined: the mixer's torch projection, gate and attention), with the same tokens, and HF transformers
on the same weights (tokens equal, logits within 1e-4). The records and the runs against the per-layer one-call
step, which runs the same C code, are bit for bit (test_more_layer_records.py, test_program_run.py)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import kernel_status
from hybridcache.accel.mixers.attention import AttentionAccel
from hybridcache.accel.runs import decode_run, layer_records
from tests.models.conftest import hf_generate, left_padded, prompts
from tests.models.test_pre_norm_records import _cache_state

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


def _served(monkeypatch) -> list:
    """Layer by layer (no records), which calls the one-call step served (True) or declined (False)."""
    monkeypatch.setattr(layer_records, "record_step", lambda *a: None)
    seen, real = [], AttentionAccel.one_call_step

    def counted(self, *a):
        out = real(self, *a)
        seen.append(out[0] is not None)
        return out

    monkeypatch.setattr(AttentionAccel, "one_call_step", counted)
    return seen


def test_the_gated_step_is_the_reference_within_float32_noise(checkpoints, monkeypatch):
    model = hc.from_pretrained(checkpoints("qwen3_5"))
    gated = [m for m in model.modules() if isinstance(m.__dict__.get("accel"), AttentionAccel) and m.output_gate]
    assert gated  # (the tiny checkpoint has gated attention layers)
    ids, mask = left_padded(2, 7, seed=5)
    with monkeypatch.context() as m:
        served = _served(m)
        out = hc.generate(model, ids, attention_mask=mask, max_new_tokens=10)
    assert served and all(served)  # every gated attention of every decode step in one call
    with monkeypatch.context() as m:  # the reference: the mixer's own projection, gate and attention in torch
        m.setattr(layer_records, "record_step", lambda *a: None)
        m.setattr(AttentionAccel, "one_call_step", lambda self, *a: (None, None))
        want = hc.generate(model, ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    got_cache, want_cache = _cache_state(out.cache), _cache_state(want.cache)
    assert torch.equal(got_cache[0], want_cache[0])  # (the token counts)
    for got, want in zip(got_cache[1:], want_cache[1:], strict=True):  # keys, values, positions; states
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_greedy_runs_give_hf_tokens(checkpoints, monkeypatch):
    """One row, greedy: decode runs over the layer program and the C loop (hc_program_steps) against HF."""
    import transformers

    path = checkpoints("qwen3_5")
    model = hc.from_pretrained(path)
    ids = prompts(1, 9, seed=3)
    started, real = [], decode_run.DecodeRun.start.__func__

    def start(cls, *args):
        run = real(cls, *args)
        started.append(run is not None)
        return run

    monkeypatch.setattr(decode_run.DecodeRun, "start", classmethod(start))
    got = hc.generate(model, ids, max_new_tokens=16)
    assert started and all(started)  # (the whole decode in runs: every layer recorded)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_ids, hf_logits = hf_generate(hf, ids, torch.ones_like(ids), 16)
    assert torch.equal(got.sequences, hf_ids)
    torch.testing.assert_close(got.logits, hf_logits, rtol=1e-4, atol=1e-4)

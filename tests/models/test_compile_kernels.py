"""Compiled decode runs the C kernels eager decode runs (hybridcache/accel/native/kernel_calls.py): the compiled graph
holds
the hybridcache::<op> calls (counted in the FX graphs torch.compile hands its backend), the logits of a compiled
decode equal eager decode's bit for bit over the same preallocated cache, and there are no graph breaks.

Gemma 3 compiles with inductor, the backend compiled decode uses: every step of its math is an op but a few exact
ones (the embedding scale, casts), so inductor cannot change a bit. The hybrid families keep torch math around the
ops (Jamba's conv step and dt / B / C split, LFM2's short conv, GPT-OSS's expert routing), which inductor fuses into
its own loops that round differently (1e-6 .. 6e-6 on their logits; tests/models/test_compile.py bounds that): those
compile with aot_eager (the same graph, its ATen ops run as eager runs them), which must give eager's bits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

import hybridcache as hc
from hybridcache.accel import kernel_status
from tests.models.conftest import prompts, without_recurrent_steps

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")

# family -> (backend, the ops its decode step must call in the compiled graph: Gemma 3's fused q/k/v + norms + rotary
# and the rest of each layer after attention (decoder_tail), Jamba's / LFM2's norms and attention, GPT-OSS's
# attention with sinks)
WANT = {
    "gemma3": ("inductor", {"qkv_norm_rope", "decode_attention", "decoder_tail", "decode_linear", "rms_norm"}),
    "jamba": ("aot_eager", {"decode_attention", "rms_norm", "decode_linear", "selective_scan"}),
    "lfm2": ("aot_eager", {"decode_attention", "rms_norm", "decode_linear"}),
    "gpt_oss": ("aot_eager", {"decode_attention", "rms_norm", "decode_linear", "rope_tables"}),
}


def _hybridcache_ops(gm: torch.fx.GraphModule) -> Counter:
    found = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("hybridcache."):
            found[str(node.target).split(".")[1]] += 1
    return found


@pytest.mark.parametrize("family", sorted(WANT))
def test_compiled_decode_calls_the_kernel_ops_and_equals_eager(family, models, monkeypatch):
    ours, _ = models(family)
    without_recurrent_steps(ours, monkeypatch)  # eager and compiled: the same kernels (the steps are eager only)
    backend, want = WANT[family]
    ids = prompts(2, 11, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    # the eager step over the same preallocated cache as the compiled one (compile=True with an uncompiled step):
    # another cache layout would sum the softmax in another order
    ours._compiled_decode_step = ours.forward_block
    try:
        eager = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=6, compile=True)
    finally:
        del ours._compiled_decode_step
    seen: Counter = Counter()

    def counting(gm, example_inputs):  # the graph dynamo traced, before inductor lowers it
        seen.update(_hybridcache_ops(gm))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    ours._compiled_decode_step = torch.compile(ours.forward_block, dynamic=True, backend=counting)
    try:
        compiled = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=6, compile=True)
    finally:
        del ours._compiled_decode_step
        torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert want <= set(seen), (want - set(seen), seen)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert torch.equal(eager.logits, compiled.logits), (eager.logits - compiled.logits).abs().max().item()

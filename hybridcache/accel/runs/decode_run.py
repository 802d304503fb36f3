"""Decode steps whose cache bookkeeping runs once per run of steps instead of once per layer and step.

An eager decode step of a model whose layers all record (layer_records.py: Gemma 3's whole layer in one C call)
still pays, per layer and step, the cache's reservation of the token's slot, its commit, and the checks that build
the layer's record: ~2 ms of Python a step on Gemma 3 270M (a sixth of an int8 step), run with the caches cold
after each step's weights. A run pays them once. The cache reserves room for up to `capacity` tokens after every
layer's held slots and stays held (Cache.reserve_decode); the first step builds each layer's record by its checked
call (`run.record`, as layer_records does); each later step changes only what moves with the step in those records
(the slot and slot count, the rotary tables, the query position, the input), and the kernels write each token's
keys and values into the next reserved slot. When the run ends the tokens are fed as one block
(Cache.feed_reserved), which leaves the cache as that many one-token blocks would.

The same kernels on the same inputs: the attention reads the same visible slots (its output depends on those only,
so older slots that a step-by-step decode would have evicted meanwhile change nothing), so the same logits bit for
bit and the same cache after (tests/models/test_decode_run.py). Only inside `layer_records.steady()` (no code but
ours between the steps, so nothing else can read or change the cache or the modules meanwhile), one row, every
layer recording; anything else decodes step by step.
"""

from __future__ import annotations

import ctypes

import torch

from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.native.checks import INT_MAX, _ptr
from hybridcache.accel.native.decoder_stack import call_table, record_table, record_type
from hybridcache.accel.native.kernel_calls import takes
from hybridcache.accel.native.library import _library
from hybridcache.accel.runs.embed_head import loop_arguments, loop_result, rope_rows
from hybridcache.accel.runs.layer_records import _binding, _hooked, layer_accel, steady_bindings
from hybridcache.accel.runs.program_run import ProgramRun, _blocks
from hybridcache.accel.runs.run_base import RunBase, first_step_fits
from hybridcache.accel.slots import ReservingCache
from hybridcache.cache.core.group import CacheGroup

RUN_TOKENS = 128  # steps per run at most: the spare slots it reserves in every layer


class DecodeRun(RunBase):
    """Up to `capacity` decode steps of one model on one held cache (`start`), fed to the cache by `finish`."""

    table_step = 0  # the step the records' moving fields are set for

    @classmethod
    def start(cls, model, cache: ReservingCache, capacity: int, ids: torch.Tensor, h: torch.Tensor) -> DecodeRun | None:
        """A run of up to `capacity` steps from the cache's state, its first step's tokens `ids` [B, 1] embedded as
        h [B, 1, D]; None (nothing reserved, nothing changed) where it does not apply: then decode step by step.
        A pre-norm model's layers run as a program of records (program_run.py)."""
        blocks = _blocks(model.decoder_layers, cache.entries)[0] or []  # (Nemotron-H: its LayerRuns' blocks)
        if any(isinstance(b.__dict__.get("accel"), PreNormAccel) for b in blocks):
            return ProgramRun.start(model, cache, capacity, ids, h)
        kept = steady_bindings()
        blocks, entries = list(model.decoder_layers), list(cache.entries)
        accels = [layer_accel(b) for b in blocks]
        if (
            kept is None
            or not first_step_fits(cache, capacity, ids, h)
            or record_type() is None
            or len(blocks) != len(entries)
            or any(isinstance(e, CacheGroup) for e in entries)
            or any(a is None for a in accels)
            or any(_hooked(b) for b in blocks)
        ):
            return None
        bindings = [_binding(a, e, h, kept) for a, e in zip(accels, entries, strict=True)]
        if any(b is None for b in bindings):
            return None
        rotaries = [a.rotary() for a in accels]
        return cls._reserve_and_build(
            cache,
            capacity,
            ids,
            lambda run, by_layer: run._build(h, entries, bindings, rotaries, [by_layer[id(e)] for e in entries]),
        )

    def _build(self, h, entries, bindings, rotaries, reserved) -> bool:
        """The first step's records (False: some layer's call does not take them; nothing written)."""
        b = h.shape[0]
        ahead = self.pos0[:, None] + torch.arange(self.capacity)  # [B, capacity]: the reserved slots' positions
        for r in reserved:
            r.key_pos.narrow(1, r.end, self.capacity).copy_(ahead)  # (not the layer's until fed)
        self.bufs = (torch.empty_like(h), torch.empty_like(h))  # the layers' outputs, in turn
        self.tables = {}  # id(rotary) -> this step's (cos, sin)
        self.q_pos = self.pos0.view(b, 1)
        records, alive, pointers, x = [], [], [], h
        for i, (entry, run, rotary, r) in enumerate(zip(entries, bindings, rotaries, reserved, strict=True)):
            form = entry.spec.kernel_pattern()
            cos, sin = self._rope(rotary, self.q_pos)
            if form is None or (rotary is not None and not rotary.kernel_tables(h, cos)):
                return False
            held = r.end - r.start
            keys, values = r.keys.narrow(2, r.start, held + 1), r.values.narrow(2, r.start, held + 1)
            k_pos = r.key_pos.narrow(1, r.start, held + 1)
            y = self.bufs[i % 2]
            if r.keys.numel() > INT_MAX or r.values.numel() > INT_MAX:
                return False
            got = run.record(x, y, cos, sin, keys, values, held, self.q_pos, k_pos, *form)
            if got is None:
                return False
            records.append(got[0])
            pointers.append((x.data_ptr(), keys.data_ptr(), values.data_ptr(), k_pos.data_ptr()))
            alive.append(got[1])
            x = y
        # the C array, and what its pointers point into (the bindings hold the weights and norms alive)
        self.table, self.alive, self.bindings, self.reserved = record_table(records), alive, bindings, reserved
        self.rotaries, self.out = rotaries, x
        # the record fields that move with the step, checked once: the same tensors' pointers, the count and slot
        # (the record points into these very tensors, not copies: what later steps write there, it reads)
        for rec, rotary, r, ptrs in zip(self.table, rotaries, reserved, pointers, strict=True):
            cos, sin = self.tables.get(id(rotary), (None, None))
            want = (self.q_pos.data_ptr(), r.end - r.start, r.end - r.start + 1, _ptr(cos), _ptr(sin), *ptrs)
            got = (rec.qpos, rec.slot, rec.S, rec.cos_t, rec.sin_t, rec.x, rec.keys, rec.values, rec.kpos)
            if got != want:
                return False
        return True

    def step(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One decode step: tokens `ids` [B, 1] embedded as h [B, 1, D] through every layer, their keys and values
        written into the next reserved slots. Returns the last layer's output [B, 1, D] (a buffer the next step
        overwrites: read it first)."""
        j, table = self.steps, self.table
        if self.closed or j >= self.capacity:
            raise RuntimeError("DecodeRun.step: the run is over (finished, abandoned or full)")
        if ids.shape != (self.ids.shape[0], 1) or h.shape != self.out.shape or not takes(h) or not h.is_contiguous():
            raise ValueError(f"DecodeRun.step: ids [B, 1] and h {tuple(self.out.shape)} float32, got {tuple(h.shape)}")
        if j:
            self.q_pos = (self.pos0 + j).view(-1, 1)
            self.tables = {}
            q = self.q_pos.data_ptr()
            for rec, rotary, r in zip(table, self.rotaries, self.reserved, strict=True):
                cos, sin = self._rope(rotary, self.q_pos)
                slot = r.end - r.start + j
                rec.qpos, rec.slot, rec.S, rec.cos_t, rec.sin_t = q, slot, slot + 1, _ptr(cos), _ptr(sin)
        table[0].x = h.data_ptr()
        self.table_step = j  # the step the records' moving fields are set for
        self.step_alive = (h, self.q_pos, self.tables)  # what the records point into, until the next step
        call_table(table)
        self.ids[:, j] = ids[:, 0]
        self.steps = j + 1
        return self.out

    def greedy(self, model, first: int, k: int, eos: list[int], keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k greedy steps in one C call (csrc/cpu_decode.c hc_decode_steps: no interpreter between steps)
        from token `first`: each step embeds its token, runs the layers, the final norm and the head, and takes the
        first largest logit (the same kernels, in the same order, as `step` followed by model.head and
        greedy_next). Stops after a token in `eos`. Returns (the n tokens [n], their logits [n, V] when `keep`,
        else [1, V]); the run has then fed n tokens (`first` and the first n - 1 of those). NotImplementedError
        (nothing run) where the model's embedding or head is not a form the loop computes."""
        if self.closed:
            raise RuntimeError("DecodeRun.greedy: the run is over (finished or abandoned)")
        j, d = self.steps, self.out.shape[-1]
        head, v = loop_arguments("DecodeRun.greedy", model, first, k, eos, self.capacity - j, d, self.ids.shape[0])
        positions = self.pos0[0] + j + torch.arange(k)  # [k] (one row)
        rope, cos, sin, _tables = rope_rows("DecodeRun.greedy", zip(self.table, self.rotaries, strict=True), positions)
        stops = torch.tensor(sorted(set(eos)) or [-1], dtype=torch.int64)
        x, normed = torch.empty(d), torch.empty(d)
        logits, tokens, done = torch.empty(k if keep else 1, v), torch.empty(k, dtype=torch.int64), ctypes.c_int(0)
        n = _library().hc_decode_steps(
            ctypes.addressof(self.table), len(self.table), j - self.table_step, rope, cos, sin, positions.data_ptr(), k,
            *head, x.data_ptr(), normed.data_ptr(), logits.data_ptr(), int(keep), stops.data_ptr(), len(set(eos)),
            first, tokens.data_ptr(), ctypes.addressof(done),
        )  # fmt: skip
        return loop_result(self, "hc_decode_steps", n, done.value, first, tokens, logits, keep)

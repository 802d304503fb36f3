"""Decode runs of pre-norm models (LFM2, Bamba, Mamba, Mamba2, RecurrentGemma, Nemotron-H: nn/core/pre_norm.py):
what decode_run.py does for Gemma 3, over a program of records (csrc/layer_program.c) where attention, recurrent and
MLP-only layers mix (Nemotron-H's MLP blocks share their run's cache entry and touch no cache).

The cache is reserved once per run of up to `capacity` steps (Cache.reserve_decode): an attention layer's reserved
slots after the ones it holds, a recurrent layer's ring of state buffers apart from the states it holds
(cache/recurrent/run_states.py). The first step builds every layer's records by the checked calls
(pre_norm_layer.py: an attention layer's hc_decoder_layer record, a recurrent layer's norm, mixer step and tail);
each later step moves only what moves with the step: an attention record's slot, slot count, query position and
rotary tables, a mixer record's state pointers (step j reads ring buffer j - 1 and writes buffer j) and RG-LRU's
positions (where its recurrence restarts). When the run ends its tokens are fed as one block (Cache.feed_reserved),
which commits every layer as that many one-token blocks would. The same kernels on the same inputs as the
step-by-step decode, so the same logits bit for bit and the same cache after (tests/models/test_program_run.py).
Only inside `layer_records.steady()`, one row, every layer recording.
"""

from __future__ import annotations

import ctypes

import torch

from hybridcache.accel.layers.pre_norm import _STATE_FIELDS, PreNormAccel
from hybridcache.accel.native.checks import INT_MAX, _ptr
from hybridcache.accel.native.kernel_calls import takes
from hybridcache.accel.native.layer_program import OPS, record_types
from hybridcache.accel.native.library import _library
from hybridcache.accel.runs.embed_head import loop_arguments, loop_result, rope_rows
from hybridcache.accel.runs.layer_records import _binding, _hooked, record_accel, steady_bindings
from hybridcache.accel.runs.run_base import RunBase, first_step_fits
from hybridcache.accel.slots import ReservingCache
from hybridcache.cache.core.group import CacheGroup

_F32 = torch.float32
_NAMES = list(OPS)  # op code -> its name (the mixer kinds of pre_norm_layer._STATE_FIELDS among them)
_POSITIONED = {"rglru"}  # mixer records whose `pos` field points at the step's positions [B, 1]


class _Step:
    """The step a run's first records are built for: one real token per row and its positions [B, 1] (what the
    mixers' `prepare` asks: RG-LRU reads where a row's recurrence restarts)."""

    all_real = True

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions


class _RunLayer:
    """A recurrent cache layer as the first step's checked record sees it (slots.StateSlots): the states the run's
    first step reads (its ring's last buffer), never the layer's held ones; `update` is never called."""

    def __init__(self, states: dict[str, torch.Tensor]) -> None:
        self._states = states

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self._states

    def update(self, valid=None, trail=None, **new_states) -> None:
        raise RuntimeError("a decode run's layer takes no update: its states are fed when the run ends")

    def trail_length(self, tokens: int) -> int:
        return 0


def _blocks(layers, entries) -> tuple[list | None, list]:
    """The decoder layers one by one, each with its cache entry: a family whose decoder layer is a run of layers
    sharing one entry (Nemotron-H's LayerRun: `blocks`) gives each of its blocks that entry. (None, []) where the
    layers and entries do not pair up."""
    layers, entries = list(layers), list(entries)
    if len(layers) != len(entries):
        return None, []
    blocks, paired = [], []
    for layer, entry in zip(layers, entries, strict=True):
        inner = getattr(layer, "blocks", None)
        for block in inner if isinstance(inner, list) else [layer]:
            blocks.append(block)
            paired.append(entry)
    return blocks, paired


def _one_stateful_per_entry(bindings: list, entries: list) -> bool:
    """Whether every cache entry is read and written by exactly one layer (an attention or recurrent layer; the MLP
    layers beside it touch no cache): a run reserves each entry's slots or state ring for one layer."""
    counts: dict[int, int] = {}
    for bound, entry in zip(bindings, entries, strict=True):
        counts[id(entry)] = counts.get(id(entry), 0) + (bound[0] != "mlp")
    return all(n == 1 for n in counts.values())


class ProgramRun(RunBase):
    """Up to `capacity` decode steps of a pre-norm model on one held cache (`start`), fed to the cache by `finish`
    (the interface of decode_run.DecodeRun: step, full, steps, greedy, finish, abandon)."""

    @classmethod
    def start(cls, model, cache: ReservingCache, capacity: int, ids: torch.Tensor, h: torch.Tensor):
        """A run of up to `capacity` steps from the cache's state, its first step's tokens `ids` [1, 1] embedded as
        h [1, 1, D]; None (nothing reserved, nothing changed) where it does not apply: then decode step by step."""
        kept = steady_bindings()
        blocks, entries = _blocks(model.decoder_layers, cache.entries)
        accels = [record_accel(b) for b in blocks]
        if (
            kept is None
            or blocks is None
            or not first_step_fits(cache, capacity, ids, h)
            or record_types() is None
            or any(isinstance(e, CacheGroup) for e in entries)
            or not all(isinstance(a, PreNormAccel) for a in accels)
            or any(_hooked(b) for b in blocks)
        ):
            return None
        bindings = [_binding(a, e, h, kept) for a, e in zip(accels, entries, strict=True)]
        if any(b is None for b in bindings) or not _one_stateful_per_entry(bindings, entries):
            return None
        return cls._reserve_and_build(
            cache,
            capacity,
            ids,
            lambda run, by_layer: run._build(h, entries, accels, bindings, [by_layer[id(e)] for e in entries]),
        )

    def _build(self, h, entries, accels, bindings, reserved) -> bool:
        """The first step's program (False: some layer's records do not take it; nothing written)."""
        types = record_types()
        b = h.shape[0]
        self.inp = torch.empty_like(h)  # each step's input is copied here: the records read it in place
        self.bufs = (torch.empty_like(h), torch.empty_like(h))  # the layers' outputs, in turn
        self.tables: dict[int, tuple] = {}  # id(rotary) -> this step's (cos, sin)
        self.q_pos = self.pos0.view(b, 1)
        program, alive = [], []
        self.attention, self.mixers = [], []  # (record, rotary, held slots); (record, ptr fields, ring pointers)
        self.positioned = []  # the mixer records that read the step's positions (RG-LRU's `pos`)
        self.run_pos = self.pos0[0] + torch.arange(self.capacity)  # [capacity] int64: step j's position (one row)
        x = self.inp
        for i, (entry, fast, bound, r) in enumerate(zip(entries, accels, bindings, reserved, strict=True)):
            y = self.bufs[i % 2]
            if bound[0] == "mlp":  # (a layer with no cache state: Nemotron-H's MLP blocks, one hc_pre_norm_mlp record)
                got = fast.record(x, y, None, _Step(self.q_pos), bound)
                if got is None or len(got[0]) != 1:
                    return False
                (op, args), keep = got[0][0], got[1]
                program.append((op, record_types()[op](*args)))
                alive.append(keep)
            elif bound[0] == "attention":
                got = self._attention(x, y, entry, fast, bound[1], r, bound[2])
                if got is None:
                    return False
                rec, keep, rotary = got
                program.append((bound[2], rec))  # (hc_decoder_layer, or hc_attention_layer: the same layout)
                self.attention.append((rec, rotary, r.end - r.start))
                alive.append(keep)
            else:
                if not hasattr(r, "rings"):
                    return False
                got = fast.record(x, y, _RunLayer(r.read(0)), _Step(self.q_pos), bound)
                if got is None or got[0] == "reserved" or len(got[0]) != 3:
                    return False
                ops, keep, _after = got
                recs = [types[op].from_buffer_copy(a) if type(a) is not tuple else types[op](*a) for op, a in ops]
                kind = _NAMES[ops[1][0]]
                fields = _STATE_FIELDS.get(kind)
                if fields is None or set(fields) != set(r.rings) or not self._rings_fit(r):
                    return False
                pointers = {name: [ring[k].data_ptr() for k in range(ring.shape[0])] for name, ring in r.rings.items()}
                self.mixers.append((recs[1], [(fields[n], pointers[n]) for n in r.rings]))
                if kind in _POSITIONED:
                    if recs[1].pos != self.q_pos.data_ptr():  # (the record points into this very tensor)
                        return False
                    self.positioned.append(recs[1])
                program += [(op, rec) for (op, _), rec in zip(ops, recs, strict=True)]
                alive.append(keep)
            x = y
        self.out, self.alive, self.bindings = x, alive, bindings  # (the bindings hold the scratch the records use)
        self.program = program  # (op code, its record: the C structs the call reads)
        self.ops = (ctypes.c_int * len(program))(*(op for op, _ in program))
        self.pointers = (ctypes.c_void_p * len(program))(*(ctypes.addressof(rec) for _, rec in program))
        return True

    def _attention(self, x, y, entry, fast, run, r, op: int):
        """An attention layer's hc_decoder_layer record for the first step (its slot after the held ones); None where
        the kernel does not take it."""
        form, rotary = entry.spec.kernel_pattern(), fast.rotary()
        if not hasattr(r, "keys") or form is None:
            return None
        cos, sin = self._rope(rotary, self.q_pos)
        if rotary is not None and not rotary.kernel_tables(x, cos):
            return None
        held = r.end - r.start
        r.key_pos.narrow(1, r.end, self.capacity).copy_(self.pos0[:, None] + torch.arange(self.capacity))
        keys, values = r.keys.narrow(2, r.start, held + 1), r.values.narrow(2, r.start, held + 1)
        k_pos = r.key_pos.narrow(1, r.start, held + 1)
        if r.keys.numel() > INT_MAX or r.values.numel() > INT_MAX:
            return None
        got = run.record(x, y, cos, sin, keys, values, held, self.q_pos, k_pos, *form)
        if got is None:
            return None
        rec = record_types()[op](*got[0])  # (every attention op's record is hc_decoder_layer's layout)
        # the fields later steps move, checked once: the record points into these very tensors
        want = (self.q_pos.data_ptr(), held, held + 1, _ptr(cos), _ptr(sin), x.data_ptr(), keys.data_ptr())
        if (rec.qpos, rec.slot, rec.S, rec.cos_t, rec.sin_t, rec.x, rec.keys) != want:
            return None
        return rec, got[1], rotary

    @staticmethod
    def _rings_fit(r) -> bool:
        """Whether every ring buffer is a state the checked record took: contiguous float32 of its shape."""
        states = r.read(0)
        return all(
            ring.dtype is _F32 and ring.is_contiguous() and ring.shape[1:] == states[name].shape
            for name, ring in r.rings.items()
        )

    def step(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One decode step: tokens `ids` [B, 1] embedded as h [B, 1, D] through every layer. Returns the last
        layer's output [B, 1, D] (a buffer the next step overwrites: read it first)."""
        j = self.steps
        if self.closed or j >= self.capacity:
            raise RuntimeError("ProgramRun.step: the run is over (finished, abandoned or full)")
        if ids.shape != (self.ids.shape[0], 1) or h.shape != self.inp.shape or not takes(h):
            raise ValueError(f"ProgramRun.step: ids [B, 1] and h {tuple(self.inp.shape)} float32, got {tuple(h.shape)}")
        self.inp.copy_(h)
        if j:
            self.q_pos = (self.pos0 + j).view(-1, 1)
            self.tables = {}
            q = self.q_pos.data_ptr()
            for rec, rotary, held in self.attention:
                cos, sin = self._rope(rotary, self.q_pos)
                rec.qpos, rec.slot, rec.S, rec.cos_t, rec.sin_t = q, held + j, held + j + 1, _ptr(cos), _ptr(sin)
            for rec in self.positioned:
                rec.pos = q
        for rec, states in self.mixers:
            for (read, write), ptrs in states:
                setattr(rec, read, ptrs[(j - 1) % len(ptrs)])
                setattr(rec, write, ptrs[j % len(ptrs)])
        self.step_alive = (self.q_pos, self.tables)  # what the records point into, until the next step
        failed = ctypes.c_int(-1)
        err = _library().hc_layer_program(self.ops, self.pointers, len(self.program), ctypes.addressof(failed))
        if err:
            raise MemoryError(f"hc_layer_program: record {failed.value} failed ({err}): no memory for its scratch")
        self.ids[:, j] = ids[:, 0]
        self.steps = j + 1
        return self.out

    def greedy(self, model, first: int, k: int, eos: list[int], keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k greedy steps in one C call (csrc/layer_program.c hc_program_steps: no interpreter between steps)
        from token `first`: each step embeds its token, runs the program, the final norm and the head, and takes the
        first largest logit (the same kernels, in the same order, as `step` followed by model.head and
        greedy_next). Stops after a token in `eos`. Returns (the n tokens [n], their logits [n, V] when `keep`,
        else [1, V]); the run has then fed n tokens (`first` and the first n - 1 of those). NotImplementedError
        (nothing run) where the model's embedding or head is not a form the loop computes."""
        if self.closed:
            raise RuntimeError("ProgramRun.greedy: the run is over (finished or abandoned)")
        j, d = self.steps, self.out.shape[-1]
        head, v = loop_arguments("ProgramRun.greedy", model, first, k, eos, self.capacity - j, d, self.ids.shape[0])
        positions = self.pos0[0] + j + torch.arange(k)  # [k] (one row)
        layers = [(rec, rotary) for rec, rotary, _ in self.attention]
        rope, cos, sin, _tables = rope_rows("ProgramRun.greedy", layers, positions)
        moves = self._moves()
        att, held = self._att
        stops = torch.tensor(sorted(set(eos)) or [-1], dtype=torch.int64)
        normed = torch.empty(d)
        logits, tokens, done = torch.empty(k if keep else 1, v), torch.empty(k, dtype=torch.int64), ctypes.c_int(0)
        n = _library().hc_program_steps(
            self.ops, self.pointers, len(self.program), j, att, held, rope, len(layers), cos, sin,
            positions.data_ptr(), *moves, k, *head, self.inp.data_ptr(), self.out.data_ptr(), d, normed.data_ptr(),
            logits.data_ptr(), int(keep), stops.data_ptr(), len(set(eos)), first, tokens.data_ptr(),
            ctypes.addressof(done),
        )  # fmt: skip
        return loop_result(self, "hc_program_steps", n, done.value, first, tokens, logits, keep)

    def _moves(self) -> tuple:
        """hc_program_steps' state-pointer moves (record index, field offset, ring base, stride in bytes, ring size,
        read 0 / write 1) as C arrays, built once: each field a pointer field of its record's own type."""
        if self.__dict__.get("_moves_args") is None:
            at = {id(rec): i for i, (_, rec) in enumerate(self.program)}
            rows = []
            for rec, states in self.mixers:
                for fields, ptrs in states:
                    stride = ptrs[1] - ptrs[0]
                    for write, field in enumerate(fields):
                        desc = getattr(type(rec), field)
                        if desc.size != ctypes.sizeof(ctypes.c_void_p):
                            raise RuntimeError(f"ProgramRun: record field {field} is not a pointer")
                        rows.append((at[id(rec)], desc.offset, ptrs[0], stride, len(ptrs), write))
            for rec in self.positioned:  # step s reads run_pos[s]: a "ring" of `capacity` positions, written at s
                desc, pos = type(rec).pos, self.run_pos
                if desc.size != ctypes.sizeof(ctypes.c_void_p) or pos.dtype != torch.int64 or not pos.is_contiguous():
                    raise RuntimeError("ProgramRun: a positions field is not a pointer to int64 rows")
                rows.append((at[id(rec)], desc.offset, pos.data_ptr(), pos.element_size(), self.capacity, 1))
            n = len(rows)
            cols = list(zip(*rows, strict=True)) if rows else [()] * 6
            types = (ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int)
            arrays = tuple((t * max(n, 1))(*c) for t, c in zip(types, cols, strict=True))
            self._moves_args = (*arrays, n)
            att, held = [at[id(rec)] for rec, _, _ in self.attention], [h for _, _, h in self.attention]
            self._att = ((ctypes.c_int * max(len(att), 1))(*att), (ctypes.c_long * max(len(att), 1))(*held))
        return self._moves_args

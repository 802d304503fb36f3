"""`hf_quantized`: HF transformers' `QuantizedCache` with the quanto backend, exactly as transformers 5.2 computes it
(cache_utils.QuantizedLayer / QuantoQuantizedLayer, optimum-quanto's MaxOptimizer + quantize_weight).

The flush rule, per layer (R = residual_length):
- the first block (the prefill) is quantized whole and attends to itself unquantized; the dense buffer starts empty
  and "unarmed" (HF's 1-D placeholder tensor);
- a later block attends to dequant(quantized) + dense buffer + itself. If the buffer is armed and holds at least
  R - 1 tokens (HF tests `len + 1 >= R`, whatever the block length), everything just returned is quantized anew
  (the dequantized history included: errors compound) and the buffer is emptied and unarmed again; otherwise the
  block joins the buffer, which is armed from then on.
Quantization (quanto, asymmetric min-max, `nbits` 2 or 4, scale and minimum in the layer's dtype):
- axis 0: groups of `q_group_size` consecutive elements of the row-major [B, H, N, D] tensor, i.e. per token along
  head_dim when q_group_size divides head_dim (HF's default for keys and values, unlike KIVI's per-channel keys);
- axis -1: per channel, over `q_group_size` consecutive rows of the [B * H * N, D] tensor (tokens, across heads
  and batch rows when H * N is not a multiple of the group: then batch rows cannot be selected apart).
quanto refuses a group size that does not divide H * N * D (axis 0) or B * H * N (axis -1): so does this storage,
before changing anything. Like HF it never evicts: under sliding or chunked patterns it holds every token (the mask
hides the old ones), because re-quantizing only the visible ones would not be what HF computes. Bytes are what is
held: packed codes, scales, minimums, the dense buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.core.errors import CacheConfigError, CacheCropError, CacheError
from hybridcache.cache.storage.grouped import (
    GroupedKVStorage,
    Keep,
    Staged,
    check_bits,
    is_count,
    minmax_dequantize,
    minmax_quantize,
    pack,
    unpack,
)


class HFQuantizedStorage(GroupedKVStorage):
    """transformers 5.2 `QuantizedCache(backend="quanto")` for one layer."""

    unbatched = ("k_scale", "k_min", "v_scale", "v_min")  # quanto's groups: [n_groups, 1] or [n_groups, D]

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Any = "cpu",
        *,
        nbits: int = 4,
        axis_key: int = 0,
        axis_value: int = 0,
        q_group_size: int = 64,
        residual_length: int = 128,
    ) -> None:
        check_bits("hf_quantized", nbits, head_dim)
        for name, axis in (("axis_key", axis_key), ("axis_value", axis_value)):
            if axis not in (0, -1) or isinstance(axis, bool):
                raise CacheConfigError(f"hf_quantized: {name} must be 0 or -1 (quanto), got {axis!r}")
        for name, n, least, what in (
            ("q_group_size", q_group_size, 1, "positive"),
            ("residual_length", residual_length, 0, "non-negative"),
        ):
            if not is_count(n, least):
                raise CacheConfigError(f"hf_quantized: {name} must be a {what} integer, got {n!r}")
        self.bits, self.axes, self.group_size, self.residual_length = (
            nbits,
            (axis_key, axis_value),
            q_group_size,
            residual_length,
        )
        super().__init__(batch, num_kv_heads, head_dim, dtype, device)

    def empty_state(self) -> dict[str, Any]:
        b, h, d, dev = self.batch, self.heads, self.head_dim, self.device
        state: dict[str, Any] = dict(columns=0, armed=False, pos=torch.zeros(b, 0, dtype=torch.long, device=dev))
        for side in "kv":
            state[f"{side}_dense"] = torch.zeros(b, h, 0, d, dtype=self.dtype, device=dev)
            axis = self.axes["kv".index(side)]
            state.update(zip((f"{side}_codes", f"{side}_scale", f"{side}_min"), self._empty_quantized(axis)))
        return state

    def _empty_quantized(self, axis: int) -> tuple[torch.Tensor, ...]:
        codes = torch.zeros(
            self.batch, self.heads, 0, self.head_dim * self.bits // 8, dtype=torch.uint8, device=self.device
        )
        # the shape quantize gives along `axis` ([n, 1] / [n, D]), so snapshots of any state have one layout
        none = torch.zeros(0, 1 if axis == 0 else self.head_dim, dtype=self.dtype, device=self.device)
        return codes, none, none

    # -- quanto's grouping -------------------------------------------------------------------------------------
    def _check_groups(self, shape: tuple[int, ...], axis: int) -> None:
        b, h, n, d = shape
        numel = h * n * d if axis == 0 else b * h * n  # what quanto splits into groups for each index along axis
        if self.group_size > numel or numel % self.group_size:
            raise CacheError(
                f"hf_quantized: quanto cannot quantize {n} tokens [B, H, N, D] = {tuple(shape)} along "
                f"axis {axis}: q_group_size {self.group_size} must divide {numel} (HF raises here too)"
            )

    def quantize(self, x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, H, N, D] -> packed codes [B, H, N, D * bits / 8], scale and minimum (axis 0: [n_groups, 1]; axis
        -1: [n_groups, D]), quanto's groups."""
        self._check_groups(tuple(x.shape), axis)
        g, d = self.group_size, x.shape[-1]
        grouped = x.reshape(-1, g) if axis == 0 else x.reshape(-1, g, d)  # [n, G] / [n, G, D]
        codes, scale, lo = minmax_quantize(grouped, self.bits, dim=1)
        if axis == -1:
            scale, lo = scale.squeeze(1), lo.squeeze(1)
        return pack(codes.reshape(x.shape), self.bits), scale, lo

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, axis: int) -> torch.Tensor:
        q = unpack(codes, self.bits)  # [B, H, N, D]
        if axis == 0:
            return minmax_dequantize(q.reshape(-1, self.group_size), scale, lo).reshape(q.shape)
        grouped = q.reshape(-1, self.group_size, q.shape[-1])
        return minmax_dequantize(grouped, scale.unsqueeze(1), lo.unsqueeze(1)).reshape(q.shape)

    # -- the interface -----------------------------------------------------------------------------------------
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._state
        return tuple(
            torch.cat([self.dequantize(s[f"{x}_codes"], s[f"{x}_scale"], s[f"{x}_min"], axis), s[f"{x}_dense"]], dim=2)
            for x, axis in zip("kv", self.axes)
        )

    def prepare(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> Staged:
        self.check_block(k, v, pos)
        s = self._state
        nxt = dict(s, columns=s["columns"] + k.shape[2], pos=torch.cat([s["pos"], pos], dim=1))
        if s["columns"] == 0:  # HF's lazy initialisation: the prefill is stored quantized, returned as given
            for side, x, axis in (("k", k, self.axes[0]), ("v", v, self.axes[1])):
                nxt.update(zip((f"{side}_codes", f"{side}_scale", f"{side}_min"), self.quantize(x, axis)))
            return Staged(k, v, nxt["pos"], nxt)
        views = []
        for side, x, axis in (("k", k, self.axes[0]), ("v", v, self.axes[1])):
            held = self.dequantize(s[f"{side}_codes"], s[f"{side}_scale"], s[f"{side}_min"], axis)
            views.append(torch.cat([held, s[f"{side}_dense"], x], dim=2))  # [B, H, S + T, D]
        flush = s["armed"] and s["k_dense"].shape[2] + 1 >= self.residual_length
        for side, view, x, axis in (("k", views[0], k, self.axes[0]), ("v", views[1], v, self.axes[1])):
            if flush:  # everything returned is quantized anew
                nxt.update(zip((f"{side}_codes", f"{side}_scale", f"{side}_min"), self.quantize(view, axis)))
                nxt[f"{side}_dense"] = s[f"{side}_dense"][:, :, :0]
            else:
                nxt[f"{side}_dense"] = torch.cat([s[f"{side}_dense"], x], dim=2)
        nxt["armed"] = not flush
        return Staged(views[0], views[1], nxt["pos"], nxt)

    def _evict(self, state: dict[str, Any], keep: Keep) -> dict[str, Any]:
        return state  # HF holds everything (see the module doc)

    def _crop(self, state: dict[str, Any], columns: int) -> dict[str, Any]:
        s, drop = dict(state), state["columns"] - columns
        if drop == 0:
            return s
        # exact only when the dropped blocks all went to the dense buffer and the buffer stays armed
        if drop > s["k_dense"].shape[2] or (drop == s["k_dense"].shape[2] and s["armed"]):
            raise CacheCropError(
                f"hf_quantized: cannot crop {s['columns']} -> {columns} tokens exactly: some of the "
                f"dropped tokens were quantized with the kept ones (or the buffer would go back to "
                f"its unarmed state); take a snapshot before the tokens you may roll back"
            )
        s.update(
            columns=columns,
            pos=s["pos"][:, :-drop],
            k_dense=s["k_dense"][:, :, :-drop],
            v_dense=s["v_dense"][:, :, :-drop],
        )
        return s

    def _select_rows(self, state: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        out = {n: t for n, t in state.items()}
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if name.endswith(("_scale", "_min")) and t.shape[0]:
                rows = t.reshape(self.batch, -1, *t.shape[1:]) if t.shape[0] % self.batch == 0 else None
                if rows is None or (
                    self.axes["kv".index(name[0])] == -1
                    and state[f"{name[0]}_codes"].shape[2] * self.heads % self.group_size
                ):
                    raise CacheError(
                        f"hf_quantized: axis -1 groups of {self.group_size} tokens cross batch rows "
                        f"here (H * N not a multiple of them): rows cannot be selected apart"
                    )
                out[name] = rows.index_select(0, index).flatten(0, 1)
            elif not name.endswith(("_scale", "_min")):
                out[name] = t.index_select(0, index)
        return out

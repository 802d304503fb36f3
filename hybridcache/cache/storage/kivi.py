"""KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"), as its authors' code
computes it (jy-yuan/KIVI, models/llama_kivi.py and quant/new_pack.py).

- keys per channel: each channel's min / max over a group of G consecutive tokens; values per token: groups of G
  elements along head_dim; asymmetric (scale = (max - min) / (2^bits - 1), code = round((x - min) / scale)), 2 or
  4 bits, scale and minimum in the layer's dtype (grouped_kv.minmax_quantize).
- the recent tokens stay in full precision, with the authors' flush rules:
  keys: a prefill of L tokens quantizes its first L - L % R and keeps L % R dense; a decode step appends to the
  dense tail and, when that holds R tokens, quantizes all R (R % G == 0). Both say "columns < floor(seen / R) * R
  are quantized", which is the rule here for any block length, so key groups sit at multiples of G.
  values: a prefill quantizes all but its last R; a decode step that makes the tail R + 1 quantizes the oldest, i.e.
  "columns < seen - R are quantized".
  So the stored state depends only on how many tokens were fed, never on how they were split; a block attends to
  the held history (dequantized where quantized) and to its own keys and values unquantized, as in the authors' code.
- patterns that evict (sliding, chunked): a key group is kept until none of its G tokens is needed any more (re-
  quantizing the survivors would change what the model saw and compound the error), value tokens go one by one,
  the dense tails (< R keys, <= R values) are kept whole. Bytes are what is held.
- crop is exact only while nothing that must come back dense has been quantized (CacheCropError otherwise; use
  snapshot / restore).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.core.errors import CacheConfigError, CacheCropError
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


class KiviStorage(GroupedKVStorage):
    """KIVI-`bits` with group size `group_size` (G) and `residual_length` (R) full-precision recent tokens."""

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Any = "cpu",
        *,
        bits: int = 2,
        group_size: int = 32,
        residual_length: int = 128,
    ) -> None:
        check_bits("kivi", bits, head_dim)
        g, r = group_size, residual_length
        if not is_count(g) or head_dim % g:
            raise CacheConfigError(
                f"kivi: group_size must be a positive divisor of head_dim {head_dim} (values are "
                f"grouped along it), got {g!r}"
            )
        if not is_count(r) or r % g:
            raise CacheConfigError(
                f"kivi: residual_length must be a positive multiple of group_size {g} (keys are "
                f"flushed R at a time in groups of G), got {r!r}"
            )
        self.bits, self.group_size, self.residual_length = bits, g, r
        super().__init__(batch, num_kv_heads, head_dim, dtype, device)

    def empty_state(self) -> dict[str, Any]:
        b, h, d, dt, dev = self.batch, self.heads, self.head_dim, self.dtype, self.device
        packed = d * self.bits // 8
        return dict(
            columns=0,
            pos=torch.zeros(b, 0, dtype=torch.long, device=dev),
            k_start=0,
            k_codes=torch.zeros(b, h, 0, packed, dtype=torch.uint8, device=dev),
            k_scale=torch.zeros(b, h, 0, d, dtype=dt, device=dev),
            k_min=torch.zeros(b, h, 0, d, dtype=dt, device=dev),
            k_dense=torch.zeros(b, h, 0, d, dtype=dt, device=dev),
            v_start=0,
            v_codes=torch.zeros(b, h, 0, packed, dtype=torch.uint8, device=dev),
            v_scale=torch.zeros(b, h, 0, d // self.group_size, dtype=dt, device=dev),
            v_min=torch.zeros(b, h, 0, d // self.group_size, dtype=dt, device=dev),
            v_dense=torch.zeros(b, h, 0, d, dtype=dt, device=dev),
        )

    # -- quantization ------------------------------------------------------------------------------------------
    def quantize_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, H, n, D], n % G == 0 -> packed codes [B, H, n, D * bits / 8], scale and min [B, H, n / G, D]."""
        groups = x.unflatten(2, (-1, self.group_size))  # [B, H, n/G, G, D]: per channel over G tokens
        codes, scale, lo = minmax_quantize(groups, self.bits, dim=3)
        return pack(codes.flatten(2, 3), self.bits), scale.squeeze(3), lo.squeeze(3)

    def dequantize_keys(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        q = unpack(codes, self.bits).unflatten(2, (-1, self.group_size))  # [B, H, n/G, G, D]
        return minmax_dequantize(q, scale.unsqueeze(3), lo.unsqueeze(3)).flatten(2, 3)

    def quantize_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, H, n, D] -> packed codes [B, H, n, D * bits / 8], scale and min [B, H, n, D / G]."""
        groups = x.unflatten(3, (-1, self.group_size))  # [B, H, n, D/G, G]: per token over G elements
        codes, scale, lo = minmax_quantize(groups, self.bits, dim=4)
        return pack(codes.flatten(3), self.bits), scale.squeeze(4), lo.squeeze(4)

    def dequantize_values(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        q = unpack(codes, self.bits).unflatten(3, (-1, self.group_size))  # [B, H, n, D/G, G]
        return minmax_dequantize(q, scale.unsqueeze(4), lo.unsqueeze(4)).flatten(3)

    # -- the interface -----------------------------------------------------------------------------------------
    def _side(self, s: dict[str, Any], side: str) -> tuple[int, torch.Tensor]:
        """(first column, everything a side holds [B, H, n, D], dequantized where quantized)."""
        deq = self.dequantize_keys if side == "k" else self.dequantize_values
        quant = deq(s[f"{side}_codes"], s[f"{side}_scale"], s[f"{side}_min"])
        dense = s[f"{side}_dense"]
        start = s[f"{side}_start"] if quant.shape[2] else s["columns"] - dense.shape[2]
        return start, torch.cat([quant, dense], dim=2)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._state
        first = s["columns"] - s["pos"].shape[1]
        return tuple(held[:, :, first - start :] for start, held in (self._side(s, "k"), self._side(s, "v")))

    def prepare(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> Staged:
        self.check_block(k, v, pos)
        s, r = self._state, self.residual_length
        first = s["columns"] - s["pos"].shape[1]  # the view's first column
        views = []
        for side, new in (("k", k), ("v", v)):
            start, held = self._side(s, side)
            views.append(torch.cat([held[:, :, first - start :], new], dim=2))  # [B, H, S + T, D]
        columns = s["columns"] + k.shape[2]
        nxt = dict(s, columns=columns, pos=torch.cat([s["pos"], pos], dim=1))
        # keys: columns < floor(columns / R) * R quantized, per channel in groups of G tokens
        dense = torch.cat([s["k_dense"], k], dim=2)
        flush = (columns // r) * r - (columns - dense.shape[2])
        if flush > 0:
            codes, scale, lo = self.quantize_keys(dense[:, :, :flush])
            if s["k_codes"].shape[2] == 0:
                nxt["k_start"] = columns - dense.shape[2]
            nxt.update(
                k_codes=torch.cat([s["k_codes"], codes], 2),
                k_scale=torch.cat([s["k_scale"], scale], 2),
                k_min=torch.cat([s["k_min"], lo], 2),
            )
        nxt["k_dense"] = dense[:, :, max(flush, 0) :]
        # values: columns < columns - R quantized, per token in groups of G elements
        dense = torch.cat([s["v_dense"], v], dim=2)
        flush = dense.shape[2] - r
        if flush > 0:
            codes, scale, lo = self.quantize_values(dense[:, :, :flush])
            if s["v_codes"].shape[2] == 0:
                nxt["v_start"] = columns - dense.shape[2]
            nxt.update(
                v_codes=torch.cat([s["v_codes"], codes], 2),
                v_scale=torch.cat([s["v_scale"], scale], 2),
                v_min=torch.cat([s["v_min"], lo], 2),
            )
        nxt["v_dense"] = dense[:, :, max(flush, 0) :]
        return Staged(views[0], views[1], nxt["pos"], nxt)

    def _evict(self, state: dict[str, Any], keep: Keep) -> dict[str, Any]:
        s, g = dict(state), self.group_size
        first = s["columns"] - s["pos"].shape[1]
        needed = keep(s["pos"])  # [S]; a suffix for the built-in patterns
        cut = first + (int(needed.to(torch.uint8).argmax()) if bool(needed.any()) else needed.numel())
        groups = max(0, (cut - s["k_start"]) // g) if s["k_codes"].shape[2] else 0  # key groups wholly before cut
        if groups:
            s.update(
                k_start=s["k_start"] + groups * g,
                k_codes=s["k_codes"][:, :, groups * g :],
                k_scale=s["k_scale"][:, :, groups:],
                k_min=s["k_min"][:, :, groups:],
            )
        tokens = max(0, min(cut - s["v_start"], s["v_codes"].shape[2])) if s["v_codes"].shape[2] else 0
        if tokens:
            s.update(
                v_start=s["v_start"] + tokens,
                v_codes=s["v_codes"][:, :, tokens:],
                v_scale=s["v_scale"][:, :, tokens:],
                v_min=s["v_min"][:, :, tokens:],
            )
        starts = [
            s[f"{x}_start"] if s[f"{x}_codes"].shape[2] else s["columns"] - s[f"{x}_dense"].shape[2] for x in "kv"
        ]
        s["pos"] = s["pos"][:, max(starts) - first :]
        return s

    def _crop(self, state: dict[str, Any], columns: int) -> dict[str, Any]:
        s, r, drop = dict(state), self.residual_length, state["columns"] - columns
        if drop == 0:
            return s
        k_end = s["columns"] - s["k_dense"].shape[2]
        v_end = s["columns"] - s["v_dense"].shape[2]
        if k_end != (columns // r) * r or v_end != max(0, columns - r) or drop > s["pos"].shape[1]:
            raise CacheCropError(
                f"kivi: cannot crop {s['columns']} -> {columns} tokens exactly: tokens that would "
                f"be full precision again are already quantized (keys up to {k_end}, values up to "
                f"{v_end}, R={r}); take a snapshot before the tokens you may roll back"
            )
        s.update(
            columns=columns,
            pos=s["pos"][:, :-drop],
            k_dense=s["k_dense"][:, :, :-drop],
            v_dense=s["v_dense"][:, :, :-drop],
        )
        return s

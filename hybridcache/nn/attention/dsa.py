"""DeepSeek sparse attention with k-pools (DSA; GLM-5-Next's indexed attention): MLA (NoPE) whose queries see only
the tokens an indexer picks. HF parameter names (`self_attn.indexer.*`).

The indexer keeps, per token, a key k = k_norm(wk(h)) and gate logits g = h @ index_kpool_compress_gate^T (both
[Di]), in its own cache layer (a `full` attention layer of one head: k as keys, g as values), so crop, reorder,
snapshots and files come with it. Tokens form pools of `kpool` by position (pool p holds positions
p*kpool .. p*kpool + kpool - 1; positions exclude left padding, which is how HF's pools start at the first real
token). A pool's key is the per-channel softmax(g + ape[offset]) average of its keys. For each query the pools
whose tokens it all sees are candidates, scored sum_h w_h relu(q_h . key_p / sqrt(Di)) with w = weights_proj(h) /
sqrt(Hi) and q = wq_b(q_resid); the best index_topk / kpool are kept, plus the query's own unfinished pool (HF's
"tail"). The MLA block then attends to the kept pools' tokens within its own cache pattern. A `shared` layer
reuses the previous layer's choice (`Selection`): pools are absolute, so it applies to any layer's keys.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.cache import AttentionCacheLayer
from hybridcache.nn.attention.mla import MLAMixer, _pad
from hybridcache.nn.core.common import StepInput
from hybridcache.ops import masked_attention

Selection = tuple[torch.Tensor, torch.Tensor, int]  # allowed pools [B, T, P], first pool per row [B], kpool


class Indexer(nn.Module):
    """forward(h [B, T, D], q_resid [B, T, R], layer, step) -> the Selection of this block's queries."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, kpool: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk, self.kpool = heads, head_dim, topk, kpool
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden))

    @torch.no_grad()
    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, layer: AttentionCacheLayer, step: StepInput) -> Selection:
        b, t, _ = h.shape
        k = self.k_norm(self.wk(h))[:, None]  # [B, 1, T, Di]
        g = nn.functional.linear(h, self.index_kpool_compress_gate)[:, None]
        dtype = layer.spec.dtype
        view = layer.update(k.to(dtype), g.to(dtype))
        keys, gates = view.keys[:, 0].to(h.dtype), view.values[:, 0].to(h.dtype)  # [B, S, Di]
        kpos = view.key_positions if view.key_positions.dim() == 2 else view.key_positions[:, 0]  # [B, S]
        visible = view.mask if view.mask.dim() == 3 else view.mask[:, 0]  # [B, T, S]
        s, kp = kpos.shape[1], self.kpool
        npool = s // kp + 2  # pools a row's S slots can touch
        base = torch.where(kpos >= 0, kpos, torch.iinfo(kpos.dtype).max).amin(1).clamp_max(2**40) // kp  # [B]
        slot = kpos - base[:, None] * kp  # [B, S] position within the row's pool grid
        slot = torch.where((kpos >= 0) & (slot < npool * kp), slot, npool * kp)  # out of the grid: a spare slot
        # candidates: pools all of whose tokens this query sees
        seen = torch.zeros(b, t, npool + 1, dtype=h.dtype, device=h.device)
        seen.scatter_add_(2, (slot // kp)[:, None].expand(b, t, s), visible.to(h.dtype))
        candidate = seen[..., :npool] == kp  # [B, T, P]
        # pool keys: per-channel softmax of gate + ape over the pool's tokens
        grid_k = h.new_zeros(b, npool * kp + 1, self.head_dim).scatter_(1, slot[..., None].expand_as(keys), keys)
        grid_g = torch.full_like(grid_k, float("-inf")).scatter_(1, slot[..., None].expand_as(gates), gates)
        grid_k, grid_g = (x[:, :-1].unflatten(1, (npool, kp)) for x in (grid_k, grid_g))  # [B, P, kpool, Di]
        probs = torch.nan_to_num((grid_g + self.index_kpool_compress_ape).softmax(dim=2))
        pool_keys = (probs * grid_k).sum(2)  # [B, P, Di]
        q = self.wq_b(q_resid).unflatten(-1, (self.heads, self.head_dim))  # [B, T, Hi, Di]
        scores = torch.relu(torch.matmul(q, pool_keys.transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5)
        weights = self.weights_proj(h) * self.heads**-0.5  # [B, T, Hi]
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, P]
        index = index.masked_fill(~candidate, float("-inf"))
        top = index.topk(min(self.topk // kp, npool), dim=-1).indices
        allowed = torch.zeros_like(candidate).scatter_(2, top, True) & candidate
        own = (view.query_positions // kp - base[:, None]).clamp(0, npool - 1)  # [B, T] the query's pool
        tail = torch.zeros_like(candidate).scatter_(2, own[..., None], True) & ~candidate  # unfinished: its tail
        return allowed | tail, base, kp


def selection_mask(selection: Selection, key_positions: torch.Tensor) -> torch.Tensor:
    """[B, T, S] (or [B, H, T, S] for per-head positions [B, H, S]): True where the key's pool is selected."""
    allowed, base, kp = selection
    npool = allowed.shape[-1]
    rel = key_positions // kp - (base[:, None, None] if key_positions.dim() == 3 else base[:, None])
    inside = (key_positions >= 0) & (rel >= 0) & (rel < npool)
    rel = rel.clamp(0, npool - 1)
    if key_positions.dim() == 3:
        allowed = allowed[:, None].expand(-1, rel.shape[1], -1, -1)
    return allowed.gather(-1, rel.unsqueeze(-2).expand(*allowed.shape[:-1], rel.shape[-1])) & inside.unsqueeze(-2)


class DSAMixer(MLAMixer):
    """MLA without rotary whose queries attend to the indexer's selection; forward(h, group or layer, step, prev)
    -> (out [B, T, D], Selection). With `index` (an Indexer's arguments) it picks its own pools from its group's
    `indexer` cache layer; without, it takes `prev` (HF's shared layers)."""

    def __init__(self, hidden: int, num_heads: int, *, index: dict | None, **mla) -> None:
        super().__init__(hidden, num_heads, qk_rope_head_dim=0, **mla)
        self.indexer = Indexer(hidden, mla["q_lora_rank"], **index) if index else None

    def forward(self, h: torch.Tensor, entry, step: StepInput, prev: Selection | None = None):  # type: ignore[override]
        b, t, _ = h.shape
        layer = entry["attention"] if self.indexer is not None else entry
        q_resid = self.q_a_layernorm(self.q_a_proj(h))
        sel = self.indexer(h, q_resid, entry["indexer"], step) if self.indexer is not None else prev
        if sel is None:
            raise ValueError("a shared DSA layer needs the selection of the indexed layer before it")
        q = self.q_b_proj(q_resid).view(b, t, self.num_heads, -1).transpose(1, 2)  # [B, H, T, nope]
        kv = self.kv_b_proj(self.kv_a_layernorm(self.kv_a_proj_with_mqa(h)))
        k, v = kv.view(b, t, self.num_heads, -1).transpose(1, 2).split([self.nope, self.dv], dim=-1)
        w, dtype = self.head_dim, layer.spec.dtype
        view = layer.update(_pad(k, w).to(dtype), _pad(v, w).to(dtype))
        mask = view.mask & selection_mask(sel, view.key_positions)
        keys, values = view.keys.to(q.dtype), view.values.to(q.dtype)
        if layer.wants_attention_weights:  # score-based eviction reads the block's weights
            out, weights = masked_attention(_pad(q, w), keys, values, mask, self.scale, return_weights=True)
            layer.observe_attention(weights)
        else:
            out = masked_attention(_pad(q, w), keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), sel

"""HF's per-layer batch operations (crop, reorder_cache, batch_repeat_interleave, batch_select_indices, reset) on one
of the bridge's cache layers: a named BridgeError for every kind of bridge layer (attention, state, hybrid,
multi-state, compressed, indexed, MiniMax's linear state), after which the cache continues exactly as a fresh one fed
the same tokens."""

import pytest
import torch

from hybridcache.hf import BridgeError, cache_for
from hybridcache.hf.layers.whole_cache import WHOLE_CACHE_OPS
from tests.hf.conftest import prompts

ARGS = {
    "crop": (1,),
    "reorder_cache": (torch.tensor([1, 0]),),
    "batch_repeat_interleave": (2,),
    "batch_select_indices": (torch.tensor([1]),),
    "reset": (),
}
# families whose caches hold every kind of bridge layer between them
FAMILIES = ["llama", "jamba", "falcon_h1", "zaya", "minimax", "deepseek_v4", "glm5_next"]  # glm5_next: our checkpoint


def test_every_operation_has_arguments():
    assert set(ARGS) == set(WHOLE_CACHE_OPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_refuses_whole_cache_operations_by_name(hf_tiny, pair, family):
    model = pair(family)[0] if family == "glm5_next" else hf_tiny(family)  # HF's classes either way
    cache = cache_for(model)
    ids, mask = prompts(2, 9, seed=3)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    kinds = set()
    for layer in cache.layers:
        kinds.add(type(layer).__name__)
        for name, args in ARGS.items():
            with pytest.raises(BridgeError, match=f"^{name} acts on the whole cache at once"):
                getattr(layer, name)(*args)
        layer.offload(), layer.prefetch()  # our storage decides where tensors live: HF's per-layer calls do nothing
    assert cache.hybrid.seen.tolist() == [9, 9]
    with torch.no_grad():  # the cache still continues as a fresh one fed the same tokens does
        nxt = prompts(2, 2, seed=4)[0]
        full = torch.cat([mask, torch.ones_like(nxt)], 1)
        got = model(input_ids=nxt, attention_mask=full, cache=cache).logits
        fresh = cache_for(model)
        model(input_ids=ids, attention_mask=mask, cache=fresh)
        want = model(input_ids=nxt, attention_mask=full, cache=fresh).logits
    assert torch.equal(got, want)
    assert kinds  # at least one layer tried

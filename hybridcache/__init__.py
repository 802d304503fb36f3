"""hybridcache: caches for hybrid language models (attention patterns and recurrent states).

import hybridcache as hc
model = hc.from_pretrained(path)
out = hc.generate(model, input_ids, cache_config={"attention": {"type": "chunked", "chunk_size": 64}})
"""

from hybridcache.cache import Cache, available_layers, register_cache_layer
from hybridcache.generation.config import GenerationConfig
from hybridcache.generation.loop import GenerateOutput, generate
from hybridcache.generation.sources.beam import BeamSearchOutput, beam_search
from hybridcache.generation.sources.drafts import PromptLookupDraft
from hybridcache.generation.sources.speculative import EarlyExitDraft
from hybridcache.models import from_pretrained

__all__ = [
    "BeamSearchOutput",
    "beam_search",
    "Cache",
    "GenerateOutput",
    "GenerationConfig",
    "EarlyExitDraft",
    "PromptLookupDraft",
    "available_layers",
    "from_pretrained",
    "generate",
    "register_cache_layer",
]
__version__ = "0.1.0"

"""What every block gets besides its hidden states and its cache layer: the block being fed.

`StepInput` is the cache's `BlockState`: positions of the block's tokens (computed once by the Cache), which are
real, and whether the block has no padding at all.
"""

from hybridcache.cache.core.sequence import BlockState as StepInput

__all__ = ["StepInput"]

"""Compressed caches: what a compressor keeps for attention over pooled windows of the sequence (DeepSeek-V4's
heavily compressed and compressed sparse attention). One type, `compressed_kv` (compressed_kv.py)."""

from hybridcache.cache.compressed.compressed_kv import CompressedKVLayer, CompressedKVSpec

__all__ = ["CompressedKVLayer", "CompressedKVSpec"]

"""Attention mixers: grouped-query attention, MLA, DSA, KV-shared layers, rotary embeddings."""

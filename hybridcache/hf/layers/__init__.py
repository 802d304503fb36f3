"""The bridge's cache layers behind HF's layer interfaces: attention (`CacheLayerMixin`), recurrent states
(`LinearAttentionCacheLayerMixin`), a decoder layer holding both, several states, or an indexed part."""

"""Recurrent mixers: Mamba, Mamba2, Gated DeltaNet, KDA, RG-LRU, short convolution, checkpoint trails."""

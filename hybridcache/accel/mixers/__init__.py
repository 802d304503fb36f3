"""Each mixer's decode step in one C call: attention (the slot-writing step), the recurrent mixers (Mamba, Mamba2,
short conv, gated delta, RG-LRU, grouped Mamba), the delta-rule variants, and the MoE blocks' routed experts."""

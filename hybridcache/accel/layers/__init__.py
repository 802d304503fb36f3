"""Whole decoder layers as records of one C call: pre-norm layers (recurrent or attention mixer + gated MLP),
sandwich-norm layers and their tails, MLP-only blocks."""

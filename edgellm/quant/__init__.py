"""Checkpoint formats (edgellm.quant): schemes, per-format packing and loading."""

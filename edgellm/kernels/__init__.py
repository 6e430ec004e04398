"""Compute kernels (edgellm.kernels): each op's torch reference (the CPU backend)
beside its Triton kernel (the CUDA backend)."""

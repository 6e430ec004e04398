"""Matmul kernels for loaded quantized linears, one file each, chosen by can_implement (base.py).

Kernels still in edgellm/quant/backends.py (dense, Triton int4, torch int4 GEMV, W8A8, FP8) move here
one at a time; cpu_int.py is the integer-dot CPU kernel of mode auto.
"""

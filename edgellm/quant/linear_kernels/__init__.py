"""Matmul kernels for loaded quantized linears, one file each; edgellm/quant/backends.py chooses.

dense.py (the exact fallback), triton.py (CUDA int4 and grouped int8), cpu_int.py (mode auto's
integer dots), cpu_fast.py (mode fast's int4 GEMV and bf16 copies), w8a8.py (8-bit weights and
activations, FP8), and the logits heads cpu_int_head.py / cpu_fast_head.py; onednn.py holds the
bf16 matmul helpers; base.py the interface and the chooser over candidates.
"""

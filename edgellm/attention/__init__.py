"""Attention backends over the paged KV cache: one small interface (base.py), one file per
backend (torch_ref.py, cpu.py, triton.py), chosen once per load (choose.py)."""

"""Random GGUF weight rows for kernel benchmarks and tests: valid blocks of any supported GGML
type without a model file."""

from __future__ import annotations

import numpy as np
import torch

from edgellm.quant.gguf_blocks import BLOCK_BYTES

# where each type keeps its fp16 factors (d, and dmin / m), as byte offsets in the block
FP16_AT = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q3_K": (108,),
    "Q2_K": (80, 82),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_rows(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k weights as random valid blocks of `type_name`, uint8 [n, bytes per row]:
    random bytes, with the fp16 factors set to random finite values of either sign and varied
    magnitude."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[type_name]
    per_row = k // (256 if type_name.endswith("_K") or type_name == "IQ4_XS" else 32)
    blocks = rng.integers(0, 256, (n * per_row, size), dtype=np.uint8)
    for at in FP16_AT[type_name]:
        f = (rng.standard_normal(len(blocks)) * 10.0 ** rng.uniform(-4, -1, len(blocks))).astype(
            np.float16
        )
        blocks[:, at : at + 2] = f.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, per_row * size))

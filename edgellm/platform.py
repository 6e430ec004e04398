"""The host a model runs on, decided once per load and handed to what builds the model's ops.

A Platform says which CPU kernel mode runs the quantized linears and at which instruction-set
level (edgellm/cpu_isa.py), and it owns the load's budget of dense weight copies. The loader
builds one from the EngineConfig (plus the EDGELLM_* defaults of edgellm/env.py) and passes it
to the quant scheme; nothing is switched on modules afterwards by process-wide flags.

CPU modes for quantized linears:
- "auto": the fastest this CPU has. Weights stay quantized; decode-sized steps
  run integer dot products over int8-quantized activations (edgellm/kernels/csrc/cpu/qgemm.cpp: AVX2
  vpmaddubsw, on every x86-64-v3 CPU); larger steps take whichever of that and a dense matmul
  (fp32, or bf16 where the CPU has bf16 units) measured faster for this model at load.
- "exact": every weight dequantized once, fp32 matmuls: the same logits as transformers.
- "fast": torch's int4 GEMV with bf16 activations and bf16 matmuls beyond; built for CPUs with
  bf16 units (AMX, AVX512-BF16); elsewhere bf16 is emulated, far slower than fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from edgellm import env
from edgellm.cpu_isa import CpuIsa, select
from edgellm.quant.linear_kernels.onednn import packed_available

logger = logging.getLogger(__name__)

CPU_QUANT_MODES = ("auto", "exact", "fast")
DEFAULT_CPU_QUANT = "auto"


def resolve_cpu_quant(value: str | None) -> str:
    """The mode a load runs: `value`, else $EDGELLM_CPU_QUANT, else auto."""
    mode = (value or env.cpu_quant() or DEFAULT_CPU_QUANT).lower()
    if mode not in CPU_QUANT_MODES:
        source = "cpu_quant" if value else env.CPU_QUANT
        raise ValueError(f"{source}={mode!r}: choose one of {', '.join(CPU_QUANT_MODES)}")
    return mode


@dataclass
class Platform:
    """CPU kernel choices for one model load (also used on CUDA, where only cpu_quant's default
    matters: GPU kernels are chosen by device)."""

    cpu_quant: str | None = None  # None: $EDGELLM_CPU_QUANT, else auto
    isa: CpuIsa = field(default_factory=select)
    dense_budget: int = field(default_factory=env.cpu_dense_cache_bytes)  # bytes, this load
    dense_used: int = 0
    packed_bf16: bool = field(default_factory=packed_available)  # bf16 copies in oneDNN's layout

    def __post_init__(self) -> None:
        self.cpu_quant = resolve_cpu_quant(self.cpu_quant)
        if self.cpu_quant == "auto" and self.isa.level == "none":
            logger.warning(
                "this CPU has no AVX2 (%s): quantized linears run the exact torch path",
                self.isa.features.model or "unknown CPU",
            )
            self.cpu_quant = "exact"
        if self.cpu_quant == "fast" and not self.isa.bf16_units:
            logger.warning(
                "--cpu-quant fast runs bf16 matmuls, and this CPU (%s) has no bf16 units: "
                "expect it to be slow; auto is the fast mode here",
                self.isa.describe(),
            )

    @classmethod
    def create(cls, cpu_quant: str | None = None, cpu_isa: str | None = None) -> Platform:
        return cls(cpu_quant, select(cpu_isa))

    @property
    def int_dot(self) -> bool:
        """Integer-dot kernels for quantized linears (mode auto on an AVX2 CPU or better)."""
        return self.cpu_quant == "auto"

    def native(self):
        """The C++ CPU kernels built for this level (edgellm/kernels/cpu_native.py), or None."""
        if self.isa.level == "none":
            return None
        from edgellm.kernels import cpu_native

        return cpu_native.load(self.isa)

    def reserve_dense(self, nbytes: int) -> bool:
        """Take `nbytes` of this load's dense-copy budget; False when it would run over."""
        if self.dense_used + nbytes > self.dense_budget:
            return False
        self.dense_used += nbytes
        return True

    def describe(self) -> str:
        return f"cpu quant {self.cpu_quant}, isa {self.isa.describe()}"

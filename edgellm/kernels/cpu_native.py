"""C++ kernels for fp32 models on CPU (both --cpu-quant modes): decode attention over the
paged KV cache, and a fused decode pass over all decoder layers.

decode_attention (the CPU attention backend's decode rows, edgellm/attention/cpu.py): the torch
reference (paged_attention.paged_attention_ref)
gathers every sequence's blocks into a contiguous copy and runs SDPA with an
additive mask: three passes over the context and ~10 torch ops per layer. This
kernel reads K and V straight from the pages, once each, with one program per
(sequence, kv head) spread over torch's intra-op threads (at::parallel_for):
the G query heads sharing that kv head (GQA) score every position, softmax in
fp32, then accumulate V. With AVX-512 (the build is for the host ISA) and a head
size that is a multiple of 16, both passes go 16 tokens at a time with every
head of the item over the tile while it is in L1 and the next tile prefetched
(pages sit anywhere in the cache); the 16 scores of a tile come out of one
transpose-and-add tree, and the V accumulators stay in registers over the tile.
Scalar loops otherwise. Summation order is the same either way. Built with
-fopenmp so at::parallel_for really runs on torch's threads (it is inline
OpenMP; without the flag it is a serial loop). Same cache layout as
everywhere: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], fp32.

decode_layers: a decode-only step (one token per sequence) through every
decoder layer in one call: RMSNorm, the qkv / o / gate_up / down matmuls
(torch's int4 GEMV with bf16 activations up to `int4_max_rows` rows, else the
layer's bf16 or fp32 dense matrix; the same ATen ops the Python path calls),
rotary (neox halves), the K/V write, the attention above, SiLU-and-mul and
both residual adds. What it removes is the per-op Python and dispatcher cost
of ~40 small ops per layer, which dominates a small model's decode step at low batch. The Python
model (models/decoder.FusedDecode) decides when it
applies and falls back to the layer-by-layer path otherwise.

The C++ lives in edgellm/kernels/csrc/cpu/: vec.h (the vector helpers the kernels
share: 16 fp32 lanes as one zmm on AVX-512 or two ymm on AVX2), one op per
.cpp (attention.cpp, decode_layers.cpp, norm.cpp, rotary.cpp, activation.cpp,
qacts.cpp for the activations' int8 quantization, qgemm.cpp / qgemm_n16.cpp /
qgemm_amx.cpp for the integer-dot matmuls (row layout on AVX2, the 16-row
interleaved layout on VNNI CPUs: qgemm_n16_zmm.cpp for AVX-512 VNNI,
qgemm_n16_ymm.cpp for AVX-VNNI, AMX tiles), cascade_attention.cpp for shared-prefix
prefill attention in bf16 products, logits_head.cpp for the int8
logits head; small headers for what one needs from another) and bindings.cpp (the
Python module), built once per ISA level (edgellm/cpu_isa.py). It is compiled on first use with
torch.utils.cpp_extension.load (g++, ninja and torch's headers; once per machine,
cached under $EDGELLM_CACHE/torch_extensions, keyed by every source
and header, the flags, this CPU's flags since it is built for the host ISA,
and the torch version). When the build fails or is disabled
(EDGELLM_CPU_NATIVE=torch) the torch paths run instead, with one warning that
names the compiler's first error (file:line).
fp32 math, summed in another order than the torch ops (and FMA-contracted):
results agree with them to ~1e-6 relative (tests/kernels/test_cpu_native.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from edgellm import env
from edgellm.cpu_isa import CpuIsa, detect, select

logger = logging.getLogger(__name__)

ENV = env.CPU_NATIVE  # "cpp" (default) or "torch"
# -fopenmp: at::parallel_for is inline and runs its loop through OpenMP pragmas, which a build
# without the flag ignores (serial). The module then shares torch's libgomp.so.1 (loaded first,
# same soname), so torch.set_num_threads governs both. The ISA flags come from the level
# (edgellm/cpu_isa.CpuIsa.compile_flags), never -march=native.
OPENMP = ["-fopenmp"]
CSRC = Path(__file__).resolve().parent / "csrc" / "cpu"  # vec.h, one op per .cpp, bindings.cpp
BUILD_LOCK = "edgellm-build.lock"  # flock file beside torch's own "lock" in each build directory
# a compiler diagnostic naming the place of an error: "path/norm.cpp:12:5: error: ..."
_COMPILER_ERROR = re.compile(r"^.*\.(?:cpp|h):\d+:\d+: (?:fatal )?error\b.*$", re.MULTILINE)


_lock = threading.Lock()
_modules: dict[str, object] = {}  # ISA level -> built module
_failed: set[str] = set()  # levels whose build failed or is disabled (warned once)


def _cpu_flags() -> str:
    """This CPU's flags (edgellm.cpu_isa.detect), part of the build key."""
    return " ".join(sorted(detect().flags))


def _cache_root() -> Path:
    return env.cache_dir() / "torch_extensions"


def _source_key(src_dir: Path, cflags: Sequence[str]) -> str:
    """sha256 over every source and header's name and bytes, the flags, this CPU's flags and the
    torch version: a build is reused only for exactly these."""
    h = hashlib.sha256()
    for f in sorted(p for p in src_dir.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update((" ".join(cflags) + _cpu_flags() + torch.__version__).encode())
    return h.hexdigest()[:16]


def _ensure_ninja() -> None:
    if shutil.which("ninja") is None:  # the pip package's binary, when its bin dir is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _build_error(exc: BaseException) -> str:
    """What a failed build warns with: the compiler's first error line (file:line:col: error: ...)
    when the build output has one, else the exception's first line."""
    text = str(exc)
    found = _COMPILER_ERROR.search(text)
    if found:
        return found.group(0).strip()
    return text.splitlines()[0] if text else ""


@contextmanager
def _build_lock(build: Path):
    """Hold an exclusive flock on build/BUILD_LOCK while torch builds or loads there. The kernel
    drops a flock when its holder dies, so a killed build never blocks the next one; and while it
    is held no other process is building in that directory, so torch's own lock file found there
    (a file that waits forever once its writer was killed mid-build) is stale and removed."""
    with open(build / BUILD_LOCK, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build(src_dir: Path, cflags: Sequence[str] = ("-O3", *OPENMP), cache_dir: Path | None = None):
    """Compile the module from src_dir's sorted .cpp files (its headers on the include path) with
    `cflags`, under cache_dir (default $EDGELLM_CACHE/torch_extensions) in a directory named by
    _source_key. Returns (module, None), or (None, why) when the build fails (why: _build_error's
    line, prefixed by the exception's type)."""
    src_dir = Path(src_dir)
    cflags = list(cflags)
    name = f"edgellm_cpu_native_{_source_key(src_dir, cflags)}"
    build = (cache_dir if cache_dir is not None else _cache_root()) / name
    _ensure_ninja()
    try:
        from torch.utils.cpp_extension import load as load_extension

        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            module = load_extension(
                name=name,
                sources=[str(p) for p in sorted(src_dir.glob("*.cpp"))],
                extra_include_paths=[str(src_dir)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001  (no compiler, no headers: the torch paths still work)
        return None, f"{type(exc).__name__}: {_build_error(exc)}"
    return module, None


def load(isa: CpuIsa | None = None):
    """The module compiled for `isa` (default: the level edgellm.cpu_isa.select() picks), or None
    (no AVX2, build failed, or disabled by EDGELLM_CPU_NATIVE=torch: the torch paths run)."""
    isa = isa or select()
    level = isa.level
    if level in _modules or level in _failed:
        return _modules.get(level)
    with _lock:
        if level in _modules or level in _failed:
            return _modules.get(level)
        if not env.cpu_native_enabled() or level == "none":
            _failed.add(level)
            if level == "none":
                logger.warning(
                    "this CPU has no AVX2: the C++ CPU kernels are off; using the torch paths"
                )
            return None
        module, why = _build(CSRC, [*isa.compile_flags(), *OPENMP])
        if module is None:
            _failed.add(level)
            logger.warning("C++ CPU kernels unavailable (%s); using the torch paths", why)
            return None
        logger.info("C++ CPU kernels built for %s", isa.describe())
        _modules[level] = module
        return module


def decode_tables(
    block_tables: torch.Tensor, seq_lens: list[int], rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `rows` sequences' block tables (int64, contiguous) and context lengths as the
    kernels take them."""
    return block_tables[:rows].long().contiguous(), torch.tensor(seq_lens[:rows])

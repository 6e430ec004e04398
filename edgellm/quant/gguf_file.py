"""A GGUF file's header read in one pass: metadata as Python values, tensors as memory-mapped
numpy views (the layout of ggml's gguf.c / gguf-py's GGUFReader: little-endian GGUF v2 or v3,
key-value metadata, tensor infos, tensor data aligned to `general.alignment`, default 32).

gguf-py's reader builds numpy views for every element of every metadata array; a 262k-token
vocabulary (Gemma 3) took it 20 s. Here string arrays are decoded in one Python loop and
numeric arrays are one `frombuffer` each. The tensor views are shaped as gguf-py's are, so its
dequantizers take them: F32/F16/F64 and the integer types [*reversed(dims)] of their dtype,
block-quantized types and BF16 uint8 [*reversed(dims[1:]), row bytes].

Contract: every structural inconsistency (bad magic, unknown value type, a tensor beyond the
end of the file, a string running past it) raises GGUFFormatError naming what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = 0x46554747  # "GGUF" little-endian
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> numpy dtypes (8 = string, 9 = array)
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_TYPED = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    data: np.ndarray  # a read-only view of the mapped file


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFFormatError(f"truncated at byte {self.pos} (wanted {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"truncated string array at byte {pos}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError(f"a string of {n} bytes runs past the end at byte {pos}")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _STRING:
                return self.strings(count)
            if etype not in _SCALARS:
                raise GGUFFormatError(f"array of unsupported value type {etype}")
            dtype = np.dtype(_SCALARS[etype]).newbyteorder("<")
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")
        dtype = np.dtype(_SCALARS[vtype]).newbyteorder("<")
        return np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()


class GGUFFile:
    """`fields`: metadata key -> Python value (lists for arrays); `tensors`: in file order."""

    def __init__(self, path: str | Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if cur.u32() != _MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version = cur.u32()
        if version not in (2, 3):
            raise GGUFFormatError(
                f"GGUF version {version} is not supported (2 or 3; big-endian files neither)"
            )
        n_tensors, n_kv = cur.u64(), cur.u64()
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = cur.value(cur.u32())
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r}: {n_dims} dimensions")
            dims = tuple(cur.u64() for _ in range(n_dims))
            type_id, offset = cur.u32(), cur.u64()
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r}: unknown GGML type {type_id}") from None
            infos.append((name, dims, qtype, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cur.pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, qtype, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if not dims or dims[0] % block:
                raise GGUFFormatError(
                    f"tensor {name!r}: row length {dims[:1]} is not a multiple of {block}"
                )
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            nbytes = rows * dims[0] // block * block_bytes
            begin = start + offset
            if begin + nbytes > len(self._map):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
            raw = self._map[begin : begin + nbytes]
            outer = tuple(reversed(dims[1:]))
            if qtype.name in _TYPED:  # typed, shaped like the tensor
                data = raw.view(np.dtype(_TYPED[qtype.name]).newbyteorder("<")).reshape(
                    *outer, dims[0]
                )
            else:  # block-quantized types and BF16: bytes per row
                data = raw.reshape(*outer, dims[0] // block * block_bytes)
            self.tensors.append(TensorInfo(name, qtype, dims, data))

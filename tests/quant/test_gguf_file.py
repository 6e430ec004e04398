"""The GGUF header reader (edgellm/quant/gguf_file.py) against gguf-py's GGUFReader: the same
metadata values, tensor names, types, shapes and bytes, on a file gguf-py's writer made (every
metadata value type, float and block-quantized tensors) and on the embedded default model; and
clear errors on a truncated or foreign file."""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.loader import default_model_path
from edgellm.quant.gguf_file import GGUFFile, GGUFFormatError


def _same_as_gguf_py(path) -> None:
    from gguf import GGUFReader

    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(want)
    for key, value in want.items():
        assert ours.fields[key] == value, key
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in theirs.tensors
    ]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (
            a.data.dtype == b.data.dtype
            and a.data.shape == b.data.shape
            and np.array_equal(a.data, b.data)
        )


def _written(path):
    import gguf

    g = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -3)
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int8("t.i8", -5)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_tensor("f32", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", g.standard_normal((2, 7)).astype(np.float16))
    q = gguf.quants.quantize(
        g.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_written_file_reads_as_gguf_py_reads_it(tmp_path):
    _same_as_gguf_py(_written(tmp_path / "t.gguf"))


def test_the_default_model_reads_as_gguf_py_reads_it():
    _same_as_gguf_py(default_model_path())


def test_truncated_and_foreign_files_fail_clearly(tmp_path):
    path = _written(tmp_path / "t.gguf")
    data, whole = path.read_bytes(), GGUFFile(path)
    last = whole.tensors[-1].data
    # the file ends with the last tensor's alignment padding: cut one byte into its data
    data_end = (
        last.__array_interface__["data"][0]
        + last.nbytes
        - whole._map.__array_interface__["data"][0]
    )
    assert data_end < len(data)
    for cut in (3, 40, len(data) // 2, data_end - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFFile(p)
    p = tmp_path / "foreign.gguf"
    p.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(p)

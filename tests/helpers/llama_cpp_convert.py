"""Convert a tiny transformers model directory to GGUF with llama.cpp's own converter.

The model classes of llama.cpp's convert_hf_to_gguf.py write every tensor, tensor name and
`{arch}.*` key; only the vocabulary is replaced (tiny test models have no tokenizer files) by the
byte-level one of tests/helpers/gguf_files.py. Run as a script, in its own process, because the
converter brings its own copy of gguf-py:

    python tests/helpers/llama_cpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf [f32|f16|q8_0]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(llama_dir: Path, model_dir: Path, out: Path, outtype: str) -> None:
    # this repository first (llama.cpp has a `tests` folder too), then the converter, its gguf-py
    sys.path[:0] = [str(ROOT), str(llama_dir), str(llama_dir / "gguf-py")]
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    from tests.helpers.gguf_files import _add_byte_tokenizer

    ftype = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[outtype]
    hparams = ModelBase.load_hparams(model_dir, False)
    if not (model_dir / "tokenizer.json").exists():  # Gemma's converter counts the vocabulary there
        vocab = {f"<t{i}>": i for i in range(hparams["vocab_size"])}
        (model_dir / "tokenizer.json").write_text(
            json.dumps({"model": {"vocab": vocab}, "added_tokens": []})
        )
    base = get_model_class(get_model_architecture(hparams, ModelType.TEXT))

    class ByteVocab(base):  # type: ignore[misc, valid-type]
        model_arch = base.model_arch

        def set_vocab(self) -> None:
            _add_byte_tokenizer(self.gguf_writer, self.hparams["vocab_size"])

    with torch.inference_mode():
        ByteVocab(model_dir, ftype, out, eager=True).write()


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]),
        sys.argv[4] if len(sys.argv) > 4 else "f32",
    )

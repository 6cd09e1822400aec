"""Write a Hugging Face model directory as a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py`` does.

`pagoda create NAME -f Modelfile` with `FROM` a Hugging Face directory stores the model this way
(Ollama imports safetensors the same way), so the store holds one GGUF per model and llama.cpp
and Ollama can load what pagoda made. What is written:

- metadata under llama.cpp's keys (context, sizes, heads, norm epsilon, rope base and scaling;
  gguf_writer_metadata.py);
- the tokenizer (gguf_writer_tokenizer.py): byte-level BPE (`tokenizer.json`: vocabulary, merges,
  token types, bos / eos / pad, the chat template), with the `tokenizer.ggml.pre` name that
  selects the same pre-tokenization in llama.cpp. The pre-tokenizer is recognised from
  `tokenizer.json` itself; one pagoda does not recognise is refused rather than written as
  something that would split text differently. SentencePiece / Unigram tokenizers are refused too;
- tensors (gguf_writer_tensors.py) under llama.cpp's names, the `llama` architecture's Q/K rows
  permuted to its interleaved rotary order, 2-D weights in ``qtype`` (F32, F16, BF16, or the blocks
  `gguf.quants` can write: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), norms and biases in F32.

Architectures: llama (and mistral, which llama.cpp writes as llama, without its sliding window),
qwen2, qwen3, gemma3 (text: its norms stored as ``1 + w`` and its sliding-window keys, as llama.cpp's
converter writes them), phi3 (fused ``attn_qkv`` and gate/up as ``ffn_up``; LongRoPE factors as the
``rope_factors_short`` / ``rope_factors_long`` tensors), and the mixture-of-experts families:
mixtral (as llama with experts), qwen2moe, qwen3moe, olmoe. A layer's experts are stacked into one
tensor per projection (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, [experts, rows,
columns]), the router is ``ffn_gate_inp`` and Qwen2-MoE's shared expert ``ffn_*_shexp`` with its
gate ``ffn_gate_inp_shexp``; routers stay F32, as llama.cpp keeps them. The table is
models/architectures.py's, which the reader shares.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from pagoda.loader.gguf_writer_metadata import add_model_metadata
from pagoda.loader.gguf_writer_tensors import WRITABLE_QTYPES, BlockTensor, add_tensors
from pagoda.loader.gguf_writer_tokenizer import add_tokenizer
from pagoda.models.architectures import GGUF_WRITE_ARCHITECTURES

_ARCHITECTURES = GGUF_WRITE_ARCHITECTURES  # HF model_type → general.architecture


def write_gguf(hf_dir: Path | str, out_path: Path | str, qtype: str = "F16", *, name: str | None = None,
               architecture: str | None = None, customize: Callable | None = None,
               tensors: Iterable[tuple[str, np.ndarray | BlockTensor]] | None = None) -> Path:
    """Write the model in ``hf_dir`` to ``out_path`` with its 2-D weights in ``qtype``.

    ``tensors`` (Hugging Face name → float32 array, or a ``BlockTensor`` written as it is) replaces
    the directory's safetensors as the source of the weights; ``hf_dir`` then gives only the config
    and tokenizer (``pagoda quantize``, whose model may have come from a GGUF).
    ``architecture`` overrides the ``general.architecture`` written (tests of unsupported ones);
    ``customize(writer)`` may add metadata before the file is written. ValueError names what
    cannot be written (an architecture, a tokenizer, a qtype, a row length)."""
    import gguf  # deferred: gguf loads on first use

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype.upper()
    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write {qtype}: gguf can write {', '.join(WRITABLE_QTYPES)}")
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCHITECTURES.get(config.get("model_type", ""))
    if arch is None:
        raise ValueError(f"cannot write a {config.get('model_type')!r} model to GGUF: pagoda writes "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    writer = gguf.GGUFWriter(str(out_path), architecture or arch)
    try:
        add_model_metadata(writer, config, arch, name or hf_dir.name)
        file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(qtype, f"MOSTLY_{qtype}")
        writer.add_file_type(gguf.LlamaFileType[file_type])
        add_tokenizer(writer, hf_dir, config)
        add_tensors(writer, hf_dir, config, arch, qtype, tensors)
        if customize is not None:
            customize(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path

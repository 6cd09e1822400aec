"""What ``--quantization auto`` (the default) picks, and why, said once at start-up.

Users run a GGUF expecting the file's own arithmetic, as llama.cpp and Ollama give it, and an HF
checkpoint expecting the fastest mode that keeps its quality. So on the CPU:

- a GGUF: ``gguf``, the file's blocks as stored (Q4_0 / Q4_1 / Q8_0, the K-quants and IQ4 on
  pagoda's kernels; other tensor types are dequantized), computed in float32;
- an HF checkpoint: ``int8`` (Q8_0 blocks from the float weights): perplexity within 1 % of
  fp32's on SmolLM2, inside the seeds' 2-3 % for INT8, at 2.7x fp32's one-stream decode and 2x
  its batch-64 decode (benchmarks/README.md, "Quantization: speed, memory and quality");
- ``--dtype float32`` (or ``bfloat16`` / ``float16``) named by the user: no quantization, the
  weights dequantized to that dtype: greedy output equal to transformers' on the same weights.

Elsewhere (CUDA) nothing is quantized: these modes run on pagoda's CPU kernels.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"


def choose_quantization(requested: str | None, model_format: str, device: torch.device,
                        dtype: str | torch.dtype) -> tuple[str | None, str]:
    """``(mode or None, why)`` for ``--quantization auto`` (``requested`` None or "auto"); any other
    ``requested`` is returned as it is, for the caller's own checks."""
    if requested is not None and str(requested).lower() != AUTO:
        return requested, "asked for"
    if device.type != "cpu":
        return None, f"auto: the quantized modes run on the CPU, not {device.type}"
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        return None, f"auto: --dtype {dtype} asks for the weights in that dtype (exact, as transformers computes)"
    if model_format == "gguf":
        return "gguf", ("auto: a GGUF runs on its own quantized blocks, as llama.cpp runs it "
                        "(--dtype float32 dequantizes it for exact transformers parity)")
    return "int8", ("auto: Q8_0 blocks, perplexity within 1 % of fp32's at 2-3x its decode speed "
                    "(--dtype float32 for exact transformers parity)")


def announce(mode: str | None, why: str) -> None:
    logger.info("quantization: %s (%s)", mode or "none", why)

"""Calibrated quantization to GGUF (`pagoda quantize`): rtn, awq and gptq on ggml's block grid.

calibration.py reads the samples, layerwise.py runs them through the decoder layers one at a
time (the earlier layers already quantized), statistics.py records each projection's inputs,
grid.py is the Q4_0 / Q4_1 / Q8_0 value grid, rtn.py / awq.py / gptq.py choose the codes,
quantizer.py runs a whole model and writes the GGUF, command.py is the CLI.
"""

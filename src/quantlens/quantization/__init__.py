"""Quantization stage: prepare a float model, calibrate it, train it with fake quant (QAT)."""

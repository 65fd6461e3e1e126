"""Attention: one layer module, pluggable backends (PyTorch reference everywhere, Triton on GPUs)."""

"""Triton kernels for the GPU path. Imported only when a CUDA tensor needs them (the CPU path never does)."""

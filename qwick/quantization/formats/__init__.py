"""Integer weight formats as pure codecs: unpack, dequantize, pack, and repack into one kernel layout.

- `layout`: `QuantizedWeight`, the layout the W4A16 / W8A16 kernels read (int packed along K, per-group
  scales and zero points or mins), and its exact float32 dequantization.
- `awq`, `gptq`: the checkpoint formats of Qwen's -AWQ and -GPTQ-Int4 releases (unpack, dequantize, pack,
  RTN quantize, `to_internal`).
- `rtn`: round-to-nearest int4 g128 of a float weight, for quantizing bf16 checkpoints at load.
- `gguf_quant`: GGUF Q8_0 / Q5_0 / Q4_K / Q6_K tensors repacked without dequantizing.
- `reference`: `dequant_matmul`, the CPU path and the kernels' oracle.

No module here imports the `gguf` package, Triton, or the layers: the framework plugs them in.
"""

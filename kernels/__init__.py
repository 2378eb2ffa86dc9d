"""Triton kernels, installed as `megadomino.kernels`: one file per op family (kernel, launcher,
functional wrapper), each with a torch reference beside it that CPU tensors run."""

from megadomino.kernels.quantization import (
    MAX_BLOCK_SIZE,
    dequantize,
    dequantize_reduce,
    dequantize_reduce_quantize,
    dequantize_reduce_quantize_reference,
    dequantize_reduce_reference,
    dequantize_reference,
    quantize,
    quantize_reference,
    quantized_size,
    swizzled_quantize,
    swizzled_quantize_reference,
)

__all__ = [
    "MAX_BLOCK_SIZE",
    "dequantize",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "dequantize_reduce_quantize_reference",
    "dequantize_reduce_reference",
    "dequantize_reference",
    "quantize",
    "quantize_reference",
    "quantized_size",
    "swizzled_quantize",
    "swizzled_quantize_reference",
]

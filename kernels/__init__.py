"""Triton kernels, installed as `megadomino.kernels`: one module per op family (small kernels,
then the launcher, then the functional wrappers), each with a torch reference beside it that
CPU tensors run: the FP8 cast of a GEMM operand (`fp8_cast`: scale, saturate, convert, the
transposed copy and the amax in one pass, for the FP8 linears), GELU's backward with its bias
gradient (`bias_grad`), AdamW's pass over a flat buffer (`adamw_flat`, the engine's optimizer
step), each row's top-k by magnitude selected and packed (`row_topk`, the adatopk pipeline
codec's select: exact radix select per row), and block-wise int8 / int4 quantization for ZeRO++
(qwZ weights, qgZ gradients):

    quant_scheme      the scheme (its docstring is the exact specification) and the math every
                      op shares, as Triton device functions and in torch
    block_quantize    quantize, swizzled_quantize: floats -> (q, scales)
    block_dequantize  dequantize, dequantize_reduce: (q, scales) of one or more inputs -> floats
    block_requantize  dequantize_reduce_quantize: (q, scales) of several inputs -> their sum's
    quant_buffers     flat buffers and row layouts (PayloadLayout): checked, made
    quant_launch      Triton or the reference, the grid, Variant and the tiles

qgZ, the hierarchical reduce-scatter these ops serve (N = world * P gradient elements; rank
r = node * devices_per_node + local; `nodes` nodes of `devices_per_node` ranks):
1. q, s = swizzled_quantize(grad, bits, block_size, nodes, devices_per_node): partition p of
   grad (elements p*P .. p*P+P-1, the reduce-scatter partition of rank p) is written at output
   position (p % devices_per_node) * nodes + p // devices_per_node. So the output holds, for
   each local index d in order, the `nodes` partitions of the ranks (0, d), (1, d), ... .
   (DeepSpeed's swizzle: with 2 nodes x 4, partitions 0..7 come out as 0 4 1 5 2 6 3 7.)
2. Intra-node all_to_all_single of q (and s) in devices_per_node equal pieces: local rank d
   receives [devices_per_node sources][nodes][P], the partitions of ranks (*, d).
3. dequantize_reduce_quantize(q, s, devices_per_node, bits, bits, block_size, P): sums over the
   sources, giving `nodes` partitions, partition n = the node's sum for rank (n, d).
4. Inter-node all_to_all_single (ranks sharing local index d) in `nodes` pieces: rank (n, d)
   receives [nodes sources][P], each node's partial sum of its own partition.
5. dequantize_reduce(q, s, nodes, bits, block_size, P, multiplier=1 / world): the mean over all
   ranks of partition r, what reduce_scatter(grad, op=AVG) gives, up to quantization error.

Dispatch (`quant_launch.use_triton`, every op): a CUDA tensor runs the Triton kernel (one launch
per op over the whole buffer; without triton, the reference, with a warning once per op); a CPU
tensor runs the torch reference (`*_reference`, beside its op's kernel, bit-identical, the
tests' oracle), unless `force_triton=True`, which runs the same Triton kernel on CPU under
Triton's interpreter; that needs TRITON_INTERPRET=1 set before triton is first imported in the
process (tests: small inputs). No op records autograd history; all work on the current CUDA
stream. `variant` (`Variant`) picks between code paths that give the same bits; the default is
the fastest measured.
"""

from megadomino.kernels.block_dequantize import (
    dequantize,
    dequantize_reduce,
    dequantize_reduce_reference,
    dequantize_reference,
)
from megadomino.kernels.block_quantize import (
    quantize,
    quantize_reference,
    swizzled_quantize,
    swizzled_quantize_reference,
)
from megadomino.kernels.block_requantize import (
    dequantize_reduce_quantize,
    dequantize_reduce_quantize_reference,
)
from megadomino.kernels.quant_buffers import PayloadLayout
from megadomino.kernels.quant_launch import Variant
from megadomino.kernels.quant_scheme import MAX_BLOCK_SIZE, quantized_size

__all__ = [
    "MAX_BLOCK_SIZE",
    "PayloadLayout",
    "Variant",
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

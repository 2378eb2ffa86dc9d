"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding
(`layers`), the vocab-parallel cross-entropy (`cross_entropy`), FP8 GEMMs (`fp8`) and the split
backward's store of deferred weight gradients (`wgrad`)."""

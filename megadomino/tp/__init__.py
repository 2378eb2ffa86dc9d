"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding
(`layers`), the vocab-parallel cross-entropy (`cross_entropy`) and FP8 GEMMs (`fp8`)."""

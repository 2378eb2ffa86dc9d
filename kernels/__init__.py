"""Triton kernels, installed as `megadomino.kernels`: one file per op family (kernel, launcher,
autograd wrapper), each with a torch reference beside it that CPU tensors run."""

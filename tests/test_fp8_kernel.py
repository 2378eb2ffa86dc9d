"""The fused FP8 cast (kernels/fp8_cast.py) against its torch reference, bit for bit: q, its
transpose and the amax, for shapes that leave partial tiles, both FP8 formats, bf16 / fp16 / fp32
inputs, saturation, inf and NaN.

The kernel runs on CPU only under Triton's interpreter, chosen before triton is imported: the
cases run in one subprocess started with TRITON_INTERPRET=1 (`python tests/test_fp8_kernel.py`
prints their results as JSON). The interpreter's FP8 conversion truncates where rounding carries
into the exponent, so the interpreted inputs are FP8 numbers divided by a power-of-two scale
(exact after scaling: no rounding at all), and it converts NaN to a number, so there NaN
elements of q are left out (the amax still must be NaN); tests/gpu/test_gpu_compiled_pieces.py
runs the same checks on CUDA with random inputs, where the conversion rounds to nearest.
"""

from __future__ import annotations

import json

import pytest
import torch
from interpreted import interpreted_test, run_cases

from megadomino.kernels.fp8_cast import FP8_MAX, cast_transpose, cast_transpose_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def make_input(shape: tuple[int, int], dtype: torch.dtype, fp8: torch.dtype, scale: float,
               exact: bool, seed: int = 0) -> torch.Tensor:
    """Values whose scaled magnitudes span the format, a few past its max, an inf, a NaN.
    exact: every scaled value is an FP8 number (random bit patterns of the format)."""
    generator = torch.Generator().manual_seed(seed)
    numel = shape[0] * shape[1]
    if exact:
        bits = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=generator)
        values = bits.view(fp8).float()
        values = torch.where(torch.isfinite(values), values, 0.0)
    else:
        values = torch.randn(numel, generator=generator) * FP8_MAX[fp8] / 4
    values[::17] *= 4.0  # past the max: saturated
    t = (values / scale).view(shape)
    if numel > 8:
        t.view(-1)[5] = float("inf")
        t.view(-1)[7] = float("-inf")
    return t.to(dtype)


def check_cast(device: str, force_triton: bool, shape: tuple[int, int], dtype: str, fp8: str,
               exact: bool, nan: bool = False) -> None:
    scale_value = 2.0 ** 3
    t = make_input(shape, DTYPES[dtype], FORMATS[fp8], scale_value, exact).to(device)
    if nan:
        t.view(-1)[3] = float("nan")
    scale = torch.tensor(scale_value, device=device)
    for transposed in (False, True):
        for with_amax in (False, True):
            got = cast_transpose(t, scale, FORMATS[fp8], transposed, with_amax, force_triton)
            want = cast_transpose_reference(t, scale, FORMATS[fp8], transposed, with_amax)
            for name, a, b in zip(("q", "q_t", "amax"), got, want):
                if b is None:
                    assert a is None, name
                    continue
                if a.dtype in FORMATS.values():
                    same = a.view(torch.uint8) == b.view(torch.uint8)
                    if force_triton and not t.is_cuda:  # the interpreter converts NaN to a
                        same |= b.float().isnan()       # number; CUDA's cvt keeps it NaN
                else:
                    same = (a == b) | (a.isnan() & b.isnan())
                assert a.shape == b.shape and bool(same.all()), (
                    f"{name} differs (transposed={transposed}, amax={with_amax}): "
                    f"{a.float().flatten()[:6]} vs {b.float().flatten()[:6]}")


def cases() -> dict[str, tuple]:
    out = {}
    for shape in ((37, 70), (64, 64), (1, 5), (130, 3)):
        for dtype in DTYPES:
            for fp8 in FORMATS:
                out[f"{shape[0]}x{shape[1]}-{dtype}-{fp8}"] = (shape, dtype, fp8, True)
    out["nan"] = ((37, 70), "bf16", "e4m3", True, True)
    return out


CASES = cases()


test_fp8_cast_kernel_interpreted = interpreted_test(__file__, CASES)


def test_fp8_cast_reference_on_cpu() -> None:
    """Without force_triton a CPU tensor runs the reference (random values: rounding too)."""
    check_cast("cpu", False, (37, 70), "bf16", "e4m3", exact=False)


def test_fp8_cast_refuses_what_it_cannot_tile() -> None:
    with pytest.raises(ValueError, match="contiguous 2-D"):
        cast_transpose(torch.zeros(4, 6).t(), torch.tensor(1.0), torch.float8_e4m3fn, True,
                       True)


def _check_interpreted(shape, dtype, fp8, exact, *rest) -> None:
    check_cast("cpu", True, shape, dtype, fp8, exact, *rest)


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, _check_interpreted)))

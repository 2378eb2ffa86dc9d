"""megadomino: Megatron-style tensor parallelism with Domino overlap and ZeRO++.

`kernels/` is installed as `megadomino.kernels` (Triton kernels, one file per op family).
On the offline GPU machine: pip install --no-build-isolation --no-deps -e .
"""

from setuptools import setup

setup(
    name="megadomino",
    version="0.1.0",
    description="Tensor-parallel LLM training with communication hidden behind computation",
    python_requires=">=3.10",
    packages=[
        "megadomino",
        "megadomino.parallel",
        "megadomino.models",
        "megadomino.domino",
        "megadomino.zero",
        "megadomino.training",
        "megadomino.training.data",
        "megadomino.interop",
        "megadomino.kernels",
    ],
    package_dir={"megadomino.kernels": "kernels"},
    install_requires=[
        "torch>=2.11",
        "numpy",
        # torch's CUDA wheels bring triton; the CPU wheel runs the torch reference paths instead.
        "triton; platform_system == 'Linux' and platform_machine == 'x86_64' and extra == 'triton'",
        "sentencepiece",
        "safetensors",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest", "transformers"],
        "tb": ["tensorboard"],
        "triton": ["triton"],
    },
)

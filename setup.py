"""megadomino: Megatron-style tensor parallelism with Domino overlap and ZeRO++.

`kernels/` is installed as `megadomino.kernels` (Triton kernels, one file per op family).
On the offline GPU machine: pip install --no-build-isolation --no-deps -e .

Dependency ranges: lower bounds are what the oldest-dependencies job (scripts/test_oldest.sh)
runs the suite on; upper bounds only where a release is known to break us (none today).
torch's CUDA wheels pin their own triton (torch 2.11: 3.6.0); its CPU wheel brings none, so the
`test` extra adds triton, whose interpreter runs every kernel on CPU (TRITON_INTERPRET=1).
"""

from setuptools import setup

setup(
    name="megadomino",
    version="0.1.0",
    description="Tensor-parallel LLM training with communication hidden behind computation",
    python_requires=">=3.10",
    packages=[
        "megadomino",
        "megadomino.config",
        "megadomino.distributed",
        "megadomino.tp",
        "megadomino.models",
        "megadomino.overlap",
        "megadomino.overlap.domino",
        "megadomino.zero",
        "megadomino.pipeline",
        "megadomino.pipeline.placement",
        "megadomino.pipeline.reshard",
        "megadomino.data",
        "megadomino.train",
        "megadomino.train.checkpoint",
        "megadomino.cli",
        "megadomino.interop",
        "megadomino.kernels",
    ],
    package_dir={"megadomino.kernels": "kernels"},
    install_requires=[
        "torch>=2.11",
        "numpy",
        "sentencepiece",
        "safetensors",
        "tokenizers",
        # --nccl-communicator-config-path's YAML (Megatron-LM's format)
        "pyyaml",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "transformers>=4.46.1",
            # Linux wheels only; elsewhere the kernel tests skip, naming triton.
            "triton>=3.6; platform_system == 'Linux' and platform_machine in 'x86_64 aarch64'",
            # Writes and reads the Megatron-LM checkpoints of tests/test_megatron_checkpoint.py
            # (its CPU workarounds are for this release); its torch_dist writer needs psutil,
            # which it does not declare.
            "megatron-core==0.16.1",
            "psutil",
            # --tensorboard-dir, which real launch scripts pass
            # (tests/test_vendored_launch_scripts.py)
            "tensorboard",
            # benchmarks/scale_model.py's plot (tests/test_scale_model.py runs it)
            "matplotlib",
        ],
        "tb": ["tensorboard"],
        # --tokenizer-type HuggingFaceTokenizer (transformers.AutoTokenizer)
        "hf": ["transformers>=4.46.1"],
    },
)

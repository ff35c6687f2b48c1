"""xla_tp: PyTorch tensor-parallel plans on XLA (Cloud TPU) through direct sharding calls."""
from setuptools import find_packages, setup

setup(
    name="xla_tp",
    version="0.1.0",
    description="PyTorch tensor-parallel plans (ColwiseParallel/RowwiseParallel/...) applied on XLA with mark_sharding",
    packages=find_packages(include=["xla_tp", "xla_tp.*"]),
    python_requires=">=3.10",
    # torch_xla 2.9.0 is binary-linked to torch 2.9.0 and does not declare it: both pinned exactly.
    install_requires=[
        "torch==2.9.0",
        "torch_xla==2.9.0",
        "numpy",
        "pyyaml",
        "tqdm",  # the launcher's progress bar
    ],
    extras_require={
        "hf": ["transformers==5.23.0"],
        # the JAX backend (parallelize_jax); these pins install beside torch 2.9.0 / torch_xla 2.9.0
        "jax": ["jax==0.7.1", "jaxlib==0.7.1", "torchax==0.0.13"],
        "torchao": ["torchao==0.14.1"],  # low-precision optimizers; 0.14.1 is the release that imports with torch 2.9
        # LoRA adapters: peft 0.18.1 is the newest that imports beside torchao 0.14.1 (0.19+ refuse torchao < 0.16)
        "peft": ["peft==0.18.1"],
        # TPU VMs and Colab TPU runtimes: torch_xla's TPU build and its libtpu (same pin as above)
        "tpu": ["torch_xla[tpu]==2.9.0", "transformers==5.23.0"],
        # matplotlib: the bench chart; nbclient/nbformat/ipykernel: the notebook test
        # pytest-xdist: the suite runs on two workers; ruff: the linter the test command runs first
        # peft, trl, accelerate, datasets: the trainers people use (transformers' Trainer, TRL's SFTTrainer, LoRA)
        # diffusers: diffusion transformers (SD3, PixArt, Flux) planned by "auto"
        "test": ["pytest", "pytest-xdist==3.8.0", "ruff==0.17.6", "transformers==5.23.0", "matplotlib", "jax==0.7.1",
                 "jaxlib==0.7.1", "torchax==0.0.13", "torchao==0.14.1", "nbclient==0.11.0", "nbformat==5.11.1",
                 "ipykernel==7.4.0", "peft==0.18.1", "trl==1.16.0", "accelerate==1.15.0", "datasets==5.2.0",
                 "diffusers==0.42.0"],
    },
    entry_points={"console_scripts": ["xla-tp=xla_tp.cli:main"]},
)

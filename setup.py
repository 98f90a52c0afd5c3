"""megatron-flat: a Megatron-Core plugin that flattens the memory peaks of long-context MoE training."""

from setuptools import find_packages, setup

setup(
    name="megatron-flat",
    version="0.1.0",
    description=(
        "Flatten the four memory peaks of long-context MoE training in Megatron-Core "
        "(expert dispatch, vocabulary projection, checkpoint boundaries, optimizer state) "
        "without changing the math."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_flat", "megatron_flat.*"]),
    # The published measurements the planner's baselines are held to.
    package_data={"megatron_flat.plan": ["published.json"]},
    install_requires=[
        # torch is required but never pinned here: pin it in the environment first
        # (an unpinned resolve on a CPU machine would pull a multi-GB CUDA build).
        "torch>=2.4",
        "megatron-core>=0.16.1",
    ],
    extras_require={
        # pytest-xdist: scripts/test.sh runs the single-process tests on every core (3.2: work
        # stealing).
        # psutil: Megatron-Core's checkpoint writer reports its memory with it (the rehearsal's
        # --resume-at saves torch_dist checkpoints).
        "test": ["pytest>=7", "pytest-xdist>=3.2", "psutil"],
        # The demo's memory-timeline PNG.
        "demo": ["matplotlib"],
        # GPU-only accelerations, picked up when importable.
        "gpu": ["transformer-engine", "triton"],
        "apex": [],  # NVIDIA apex is built from source; listed for discoverability.
        # benchmarks/vocab.py's peers (never imported by the package). scripts/bootstrap.sh
        # installs these pins with --no-deps: they need only torch and triton.
        "bench-peers": ["liger-kernel==0.8.5", "cut-cross-entropy==25.1.1"],
    },
)

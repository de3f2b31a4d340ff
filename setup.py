"""Chameleon-Megatron: megatron.training, megatron.elastic and chameleon_ext.

`megatron` is a namespace package shared with the installed megatron-core (megatron.core), so it
has no __init__.py here. The csrc extension (chameleon_ext._C) is optional: when it cannot be
built, the pure-torch paths are used.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="chameleon-megatron",
    version="0.1.0",
    description="Fault-tolerant Megatron-style GPT training with adaptive recovery",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.training*", "megatron.elastic*",
                                              "chameleon_ext*"]),
    install_requires=["torch==2.13.0", "megatron-core==0.16.1", "numpy", "tqdm", "tensorboard"],
    extras_require={"dev": ["pytest", "pytest-timeout"]},
)

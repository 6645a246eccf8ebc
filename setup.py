"""horovod_sbc: Sparse Binary Compression (Sattler et al., arXiv 1805.08768) for Horovod.

setup.py is kept (rather than only pyproject.toml) because users' tooling expects it.
Horovod itself is not a dependency here: it must be built against the installed torch/TensorFlow
(see scripts/install.sh, which builds and caches it).
"""
from setuptools import find_packages, setup

setup(
    name="horovod_sbc",
    version="0.1.0",
    description="Sparse Binary Compression (SBC) gradient/update compression for Horovod (PyTorch, TensorFlow)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_sbc", "horovod_sbc.*"]),
    # the CPU kernels are compiled from source on first use (horovod_sbc/kernels/__init__.py)
    package_data={"horovod_sbc.kernels": ["sbc_kernels.c"]},
    python_requires=">=3.9",
    install_requires=["numpy>=1.22"],
    extras_require={
        "torch": ["torch>=2.0"],
        "tensorflow": ["tensorflow-cpu>=2.15; platform_machine=='x86_64'"],
        "test": ["pytest>=7,<9.2", "pytest-timeout", "pytest-xdist>=3", "hypothesis>=6", "scikit-learn>=1.2"],
        "bench": ["matplotlib>=3.6", "tqdm>=4", "mnist1d>=0.0.2"],
    },
    license="Apache-2.0",
)

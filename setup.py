"""Builds deep_indexer._C: a pybind11 extension compiled with the host compiler only.

No CUDA compilation happens at install time (kernels are JIT-compiled on first use) and no
CUDA library is linked (libcuda is loaded at run time), so this builds against a CPU-only torch.
"""
import os
import pathlib
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # one clear line instead of a traceback from pip's build step
    sys.exit(f"deep_indexer: PyTorch must be installed before building this package ({e}); run `pip install torch`, "
             f"then `pip install -e . --no-build-isolation` (see the README's first command)")

ROOT = pathlib.Path(__file__).resolve().parent


def cuda_include_dirs():
    """cuda.h (types and enums only; nothing is linked)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for c in candidates:
        if c and (pathlib.Path(c) / "include" / "cuda.h").exists():
            return [str(pathlib.Path(c) / "include")]
    sys.exit("deep_indexer: cuda.h not found (looked in $CUDA_HOME, $CUDA_PATH, /usr/local/cuda); install the CUDA "
             "toolkit or set CUDA_HOME to it")


class BuildPyWithHeaders(build_py):
    """Ships include/deep_indexer/* inside the package (deep_indexer/include): the JIT compiles them at
    run time. Editable installs read them from the repository instead."""

    def run(self):
        super().run()
        dst = pathlib.Path(self.build_lib) / "deep_indexer" / "include" / "deep_indexer"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(ROOT / "include" / "deep_indexer", dst)


sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))

setup(
    name="deep_indexer",
    version="0.1.0",
    description="SM90 kernels for the DeepSeek Sparse Attention lightning indexer",
    packages=find_packages(include=["deep_indexer", "deep_indexer.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "nvidia-cutlass"],
    extras_require={"test": ["pytest"], "bench": ["matplotlib"]},
    ext_modules=[
        CppExtension(
            name="deep_indexer._C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc"), str(ROOT / "include")] + cuda_include_dirs(),
            define_macros=[("FMT_HEADER_ONLY", None)],
            extra_compile_args=["-O2", "-Wno-unused-function"],  # the C++ standard is torch's choice
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithHeaders},
)

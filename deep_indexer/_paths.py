"""Where the JIT finds its headers: the project's kernels and CUTLASS/CuTe (nvidia-cutlass wheel)."""
from __future__ import annotations

import importlib.util
import os
import pathlib

from . import _env

_PKG = pathlib.Path(__file__).resolve().parent


def include_dir() -> pathlib.Path:
    """Folder holding the deep_indexer/<family>/*.cuh kernels: inside the package when installed, else the repo's include/."""
    for cand in (_PKG / "include", _PKG.parent / "include"):
        if (cand / "deep_indexer" / "common" / "ptx.cuh").is_file():
            return cand
    raise RuntimeError(f"deep_indexer: kernel headers not found next to {_PKG}; reinstall the package")


def cutlass_include_dir() -> str:
    """CUTLASS/CuTe headers of the nvidia-cutlass wheel, found without importing it (its import pulls
    cuda-python, scipy and more). DI_CUTLASS_INCLUDE overrides. Empty string when absent."""
    override = os.environ.get(_env.CUTLASS_INCLUDE)
    if override:
        return override
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        cand = pathlib.Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
        if (cand / "cutlass").is_dir():
            return str(cand)
    return ""

import os

import pytest
import torch


def _sm90_available() -> bool:
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(0) == (9, 0)


HAS_SM90 = _sm90_available()
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an SM90 (Hopper) GPU")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private JIT cache folder for tests that inspect the cache."""
    d = tmp_path / "jit-cache"
    monkeypatch.setenv("DI_JIT_CACHE_DIR", str(d))
    return d


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x,y>/(|x|^2+|y|^2) over finite entries, in float64."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fills with NaN so any element a kernel fails to write is caught."""
    return t.fill_(float("nan"))

import os
import random
import tempfile

import pytest
import torch

from deep_indexer import _env


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


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


@pytest.fixture
def fresh_seed():
    """Fresh random inputs per test; the seed is printed (shown on failure) and can be pinned."""
    seed = int(os.environ.get(_env.TEST_SEED, random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}")
    torch.manual_seed(seed)
    random.seed(seed)


def naive_logits(qd: torch.Tensor, kd: torch.Tensor, w: torch.Tensor, ranges, ncols: int) -> torch.Tensor:
    """fp64 logits of dequantized rows qd [R, H, D] against keys kd [N, D] with weights w [R, H]: row r holds
    sum_h w relu(q . k) on its key range ranges[r] = (start, end) and -inf elsewhere, [R, ncols]."""
    full = torch.einsum("rhd,nd->rhn", qd, kd).clamp_min(0).mul(w.double()[:, :, None]).sum(1)
    out = torch.full((qd.shape[0], ncols), float("-inf"), dtype=torch.float64)
    for r, (s, e) in enumerate(ranges):
        if s < e:
            out[r, s:e] = full[r, s:e]
    return out


def assert_logits_match(out: torch.Tensor, ref: torch.Tensor, clean: bool, dtype: torch.dtype, what: str = ""):
    """Valid entries (finite in the reference) within TOL; with clean, -inf exactly where the reference has it."""
    assert out.shape == ref.shape and out.dtype == dtype, (out.shape, ref.shape, out.dtype)
    out, ref = out.float(), ref.float().to(out.device)
    valid = torch.isfinite(ref)
    got = out[valid]
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} valid entries unwritten or non-finite"
    diff = calc_diff(got, ref[valid])
    assert diff < TOL[dtype], f"{what}: relative diff {diff:.3g}"
    if clean:
        neg = out == float("-inf")
        mism = neg != ~valid
        assert not mism.any(), f"{what}: -inf mask differs at {int(mism.sum())} entries, first {mism.nonzero()[:4].tolist()}"


# ------------------------------------------------------------------------------------ cache guard
# The JIT falls back to $TMPDIR/deep_indexer-$UID when its cache folder cannot be written. No test may
# leave kernels there (a test of the fallback points TMPDIR at its own tmp_path): the run fails if one did.
def _fallback_entries() -> set:
    kernels = os.path.join(tempfile.gettempdir(), f"deep_indexer-{os.getuid()}", "kernels")
    return set(os.listdir(kernels)) if os.path.isdir(kernels) else set()


def pytest_sessionstart(session):
    session.config._di_fallback_before = _fallback_entries()


def pytest_sessionfinish(session, exitstatus):
    new = _fallback_entries() - getattr(session.config, "_di_fallback_before", set())
    if new:
        print(f"\nthe tests left {len(new)} kernel(s) in the temp folder's fallback cache "
              f"{os.path.join(tempfile.gettempdir(), f'deep_indexer-{os.getuid()}')}: {sorted(new)[:5]}")
        session.exitstatus = 1


def pytest_make_parametrize_id(config, val, argname):
    """torch dtypes in test ids by name (test_x[bfloat16], so that `-k bfloat16` selects them)."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None

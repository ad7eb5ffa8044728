"""The fused FP4 -> e4m3 fold kernel (_C.fp4_fold, include/deep_indexer/logits/fp4_fold.cuh), which
quant.fold_fp4_to_e4m3 runs on SM90 GPUs: its per-row logic on the host (the header's __host__ __device__
functions built by nvcc into a small shared library) against the torch fold, its variants' compile
report, the _C validation messages (CPU), then the kernel against the torch fold bit for bit (GPU)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import requires_sm90

from deep_indexer import _C, jit, quant

FP8 = torch.float8_e4m3fn
DIMS = (32, 64, 96, 128)
_ROOT = Path(__file__).resolve().parents[1]

_HARNESS = r"""
#include <deep_indexer/logits/fp4_fold.cuh>
#include <cstring>
template <int D> static void run(const uint8_t* c, const int* sf, uint8_t* v, int* b, long long n) {
  for (long long r = 0; r < n; ++r) {
    uint32_t in[D / 8], out[D / 4];
    std::memcpy(in, c + r * (D / 2), D / 2);
    b[r] = deep_indexer::fp4_fold_detail::fold_row<D>(in, static_cast<uint32_t>(sf[r]), out);
    std::memcpy(v + r * D, out, D);
  }
}
extern "C" int fold_rows_host(const uint8_t* c, const int* sf, uint8_t* v, int* b, long long n, int d) {
  switch (d) {
    case 32: run<32>(c, sf, v, b, n); return 0;
    case 64: run<64>(c, sf, v, b, n); return 0;
    case 96: run<96>(c, sf, v, b, n); return 0;
    case 128: run<128>(c, sf, v, b, n); return 0;
  }
  return 1;
}
"""


def _nvcc() -> str | None:
    try:
        return _C.nvcc_path()
    except Exception:  # noqa: BLE001 - no CUDA toolkit: the host test is skipped
        return shutil.which("nvcc")


@pytest.fixture(scope="module")
def host_fold(tmp_path_factory):
    """The header's row fold compiled for the host: (codes uint8 [n, D / 2], sf int32 [n]) -> (vals uint8, base)."""
    nvcc = _nvcc()
    if not nvcc:
        pytest.skip("no nvcc")
    d = tmp_path_factory.mktemp("fp4_fold_host")
    (d / "h.cu").write_text(_HARNESS)
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-O2", "-std=c++17", f"-I{_ROOT / 'include'}",
                    str(d / "h.cu"), "-o", str(d / "libh.so")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(d / "libh.so"))

    def fold(codes: torch.Tensor, sf: torch.Tensor):
        codes, sf = codes.contiguous().view(torch.uint8), sf.contiguous()
        n, d2 = codes.shape
        v = torch.empty(n, 2 * d2, dtype=torch.uint8)
        b = torch.empty(n, dtype=torch.int32)
        rc = lib.fold_rows_host(ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(sf.data_ptr()),
                                ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(b.data_ptr()), ctypes.c_longlong(n),
                                ctypes.c_int(2 * d2))
        assert rc == 0
        return v, b

    return fold


def _random_rows(n: int, d: int, g: torch.Generator, device="cpu"):
    """Random code bytes and scale words (every exponent byte 0..255), with groups of only +-0 codes, all-zero
    rows, and rows of narrow exponent spans (mostly exact folds) mixed in."""
    codes = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
    sf = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    codes[::5, : d // 4] &= 0x88  # sign-only (zero magnitude) groups
    codes[3::11] &= 0x88  # whole rows of +-0
    codes[7::13] = 0
    narrow = (110 + torch.randint(0, 30, (n, 4), generator=g)).to(torch.uint8).view(torch.int32).squeeze(-1)
    sf[1::3] = narrow[1::3]
    return codes.to(device), sf.to(device)


def _words(exps) -> torch.Tensor:
    """[(e0, e1, e2, e3), ...] -> int32 scale words (byte g = e_g)."""
    return torch.tensor(exps, dtype=torch.uint8).view(torch.int32).squeeze(-1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("d", DIMS)
def test_row_logic_on_host_matches_the_torch_fold(host_fold, d):
    g = torch.Generator().manual_seed(d)
    codes, sf = _random_rows(5000, d, g)
    v, b = host_fold(codes, sf)
    tv, tb = quant.fold_fp4_to_e4m3_torch(codes, sf)
    assert torch.equal(b, tb)
    assert torch.equal(v, _bits(tv))
    rv, rb, _ = quant.fp4_to_e4m3_folded(codes, sf)  # the definition, float64
    assert torch.equal(v, _bits(rv)) and torch.equal(b, rb)


def test_row_logic_on_host_every_byte_at_every_shift(host_fold):
    """Every code byte in group 1 at every shift -40..6 below a group 0 of exponent 200 (base 194)."""
    rows = []
    words = []
    for s in range(-40, 7):
        for byte in range(256):
            row = torch.zeros(32, dtype=torch.uint8)
            row[:16] = 0x77  # group 0: magnitude 6 everywhere, the row's top
            row[16:] = byte
            rows.append(row)
            words.append((200, 194 + s, 127, 127))
    codes = torch.stack(rows)
    sf = _words(words)
    v, b = host_fold(codes, sf)
    tv, tb = quant.fold_fp4_to_e4m3_torch(codes, sf)
    assert (b == 194).all() and torch.equal(b, tb)
    assert torch.equal(v, _bits(tv))


@pytest.mark.parametrize("d", DIMS)
def test_variant_compiles_without_spills(isolated_cache, d):
    r = _C.precompile_variant("fp4_fold", {"head_dim": d}, "sm_90a")
    assert r["params"] == f"fp4_fold<head_dim={d}>"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, r
    assert 0 < r["registers"] <= 128, r


def test_variants_registered():
    vs = jit.variants(ops=["fp4_fold"])
    assert [dict(v.params)["head_dim"] for v in vs] == list(DIMS)
    assert "fp4_fold" in jit.OPS
    assert [dict(v.params)["head_dim"] for v in jit.variants(ops=["fp4_fold"], head_dims=[96, 128])] == [96, 128]
    with pytest.raises(ValueError, match="head_dim must be 32, 64, 96 or 128"):
        _C.precompile_variant("fp4_fold", {"head_dim": 48}, "sm_90a")


def test_validation_messages():
    op = "deep_indexer.fp4_fold"
    codes = torch.zeros(8, 32, dtype=torch.uint8)
    sf = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"{op}: codes must have dtype .*got Float"):
        _C.fp4_fold(codes.float(), sf)
    with pytest.raises(ValueError, match=f"{op}: codes must be 2-D"):
        _C.fp4_fold(codes.view(8, 2, 16), sf)
    with pytest.raises(ValueError, match=r"D in 32/64/96/128 .* got shape \[8, 24\]"):
        _C.fp4_fold(codes[:, :24].contiguous(), sf)
    with pytest.raises(ValueError, match=f"{op}: codes must be contiguous"):
        _C.fp4_fold(torch.zeros(8, 64, dtype=torch.uint8)[:, :32], sf)
    with pytest.raises(ValueError, match=f"{op}: sf must have dtype Int"):
        _C.fp4_fold(codes, sf.long())
    with pytest.raises(ValueError, match=rf"{op}: sf must have shape \[8\]"):
        _C.fp4_fold(codes, sf[:7])
    buf = torch.zeros(8 * 32 + 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{op}: codes must start at a 16-byte aligned address"):
        _C.fp4_fold(buf[1: 1 + 8 * 32].view(8, 32), sf)
    with pytest.raises(ValueError, match=f"{op}: codes must be on a CUDA device"):
        _C.fp4_fold(codes, sf)
    with pytest.raises(ValueError, match=f"{op}: codes must be on a CUDA device"):
        _C.fp4_fold(codes.view(torch.int8), sf)


def test_cpu_dispatch_is_the_torch_fold():
    g = torch.Generator().manual_seed(3)
    codes, sf = _random_rows(100, 64, g)
    a = quant.fold_fp4_to_e4m3(codes.view(2, 50, 32), sf.view(2, 50))
    b = quant.fold_fp4_to_e4m3_torch(codes.view(2, 50, 32), sf.view(2, 50))
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(a[1], b[1])
    assert a[0].shape == (2, 50, 64) and a[1].shape == (2, 50)


# ------------------------------------------------------------------------------------ GPU
@requires_sm90
@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("rows", [0, 1, 7, 1000, 65537])
@pytest.mark.parametrize("d", DIMS)
def test_kernel_matches_the_torch_fold(d, rows, code_dtype):
    g = torch.Generator().manual_seed(rows * 131 + d)
    codes, sf = _random_rows(rows, d, g, "cuda")
    codes = codes.view(code_dtype)
    kv, kb = _C.fp4_fold(codes, sf)
    tv, tb = quant.fold_fp4_to_e4m3_torch(codes, sf)
    assert kv.dtype == FP8 and kb.dtype == torch.int32 and kv.shape == (rows, d) and kb.shape == (rows,)
    assert torch.equal(kb, tb)
    assert torch.equal(_bits(kv), _bits(tv))
    qv, qb = quant.fold_fp4_to_e4m3(codes, sf)  # the dispatch: the kernel
    assert torch.equal(_bits(qv), _bits(tv)) and torch.equal(qb, tb)


@requires_sm90
@pytest.mark.parametrize("d", DIMS)
def test_kernel_through_quant_any_layout(d):
    """q's [S, H, D / 2] form, a non-contiguous view and an unaligned start (copied by quant; an error from _C)."""
    g = torch.Generator().manual_seed(d + 1)
    codes, sf = _random_rows(37 * 16, d, g, "cuda")
    q, q_sf = codes.view(37, 16, d // 2), sf.view(37, 16)
    for c, s in ((q, q_sf), (q.transpose(0, 1), q_sf.t())):
        v, b = quant.fold_fp4_to_e4m3(c, s)
        tv, tb = quant.fold_fp4_to_e4m3_torch(c, s)
        assert v.shape == tv.shape and b.shape == tb.shape
        assert torch.equal(_bits(v), _bits(tv)) and torch.equal(b, tb)
    n = codes.shape[0]
    buf = torch.zeros(n * d // 2 + 16, dtype=torch.uint8, device="cuda")
    un = buf[1: 1 + n * d // 2].view(n, d // 2)
    un.copy_(codes)
    with pytest.raises(ValueError, match="16-byte aligned"):
        _C.fp4_fold(un, sf)
    v, b = quant.fold_fp4_to_e4m3(un, sf)
    tv, tb = quant.fold_fp4_to_e4m3_torch(codes, sf)
    assert torch.equal(_bits(v), _bits(tv)) and torch.equal(b, tb)


@requires_sm90
def test_kernel_extreme_exponents_and_spans():
    """Exponent bytes 0 / 255 and spans far beyond 14 (inexact rows), every code byte at every shift."""
    rows, words = [], []
    for s in range(-40, 7):
        for byte in range(256):
            row = torch.zeros(64, dtype=torch.uint8)
            row[:16] = 0x7F
            row[16:48] = byte
            rows.append(row)
            words.append((200, 194 + s, 255, (byte & 1) * 255))
    codes = torch.stack(rows).cuda()
    sf = _words(words).cuda()
    v, b = _C.fp4_fold(codes, sf)
    tv, tb = quant.fold_fp4_to_e4m3_torch(codes, sf)
    rv, rb, _ = quant.fp4_to_e4m3_folded(codes.cpu(), sf.cpu())
    assert torch.equal(b, tb) and torch.equal(b.cpu(), rb)
    assert torch.equal(_bits(v), _bits(tv)) and torch.equal(_bits(v).cpu(), _bits(rv))


@requires_sm90
def test_kernel_on_the_current_stream_and_in_a_cuda_graph():
    g = torch.Generator().manual_seed(5)
    codes, sf = _random_rows(4096, 128, g, "cuda")
    want = quant.fold_fp4_to_e4m3_torch(codes, sf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = quant.fold_fp4_to_e4m3(codes, sf)  # (also compiles / loads the kernel before the capture)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant.fold_fp4_to_e4m3(codes, sf)
    codes2, sf2 = _random_rows(4096, 128, torch.Generator().manual_seed(6), "cuda")
    codes.copy_(codes2)
    sf.copy_(sf2)
    graph.replay()
    torch.cuda.synchronize()
    want2 = quant.fold_fp4_to_e4m3_torch(codes2, sf2)
    assert torch.equal(_bits(out[0]), _bits(want2[0])) and torch.equal(out[1], want2[1])

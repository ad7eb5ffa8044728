"""The fused FP4 -> e4m3 fold kernels (include/deep_indexer/logits/fp4_fold.cuh): _C.fp4_fold, which
quant.fold_fp4_to_e4m3 runs on SM90 GPUs, and _C.fp4_prefill_fold, which the prefill ops run (e4m3 values,
k_scale and scaled weights of FP4 q and k in one launch). Their per-row / per-lane logic on the host (the
header's __host__ __device__ functions built by nvcc into a small shared library) against the torch fold,
their variants' compile reports, the _C validation messages (CPU), then the kernels against the torch form
bit for bit (GPU)."""
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
// fp4_prefill_fold_kernel's lanes, one row at a time: the max of the lanes' keys, then each lane's fold.
extern "C" int prefill_fold_rows_host(const uint8_t* c, const int* sf, const float* w, uint8_t* v, float* scale,
                                      long long n, int d) {
  using namespace deep_indexer::fp4_fold_detail;
  if (d != 32 && d != 64 && d != 128) return 1;
  const int lanes = d / 16;
  for (long long r = 0; r < n; ++r) {
    uint32_t words[16];
    std::memcpy(words, c + r * (d / 2), d / 2);
    const uint32_t s = static_cast<uint32_t>(sf[r]);
    int key = 0;
    for (int j = 0; j < lanes; ++j) {
      const int k = lane_key(words[2 * j], words[2 * j + 1], static_cast<int>((s >> (8 * (j / 2))) & 0xFF));
      key = k > key ? k : key;
    }
    const int base = (key & 0xFF) - 6;
    for (int j = 0; j < lanes; ++j) {
      uint32_t o[4];
      fold_lane(words[2 * j], words[2 * j + 1], static_cast<int>((s >> (8 * (j / 2))) & 0xFF) - base, o);
      std::memcpy(v + r * d + 16 * j, o, 16);
    }
    const uint32_t bits = exp2_bits(base);
    float p;
    std::memcpy(&p, &bits, 4);
    scale[r] = w[r] * p;
  }
  return 0;
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

    def prefill_fold(codes: torch.Tensor, sf: torch.Tensor, w: torch.Tensor):
        codes, sf, w = codes.contiguous().view(torch.uint8), sf.contiguous(), w.float().contiguous()
        n, d2 = codes.shape
        v = torch.empty(n, 2 * d2, dtype=torch.uint8)
        s = torch.empty(n, dtype=torch.float32)
        rc = lib.prefill_fold_rows_host(ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(sf.data_ptr()),
                                        ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(v.data_ptr()),
                                        ctypes.c_void_p(s.data_ptr()), ctypes.c_longlong(n), ctypes.c_int(2 * d2))
        assert rc == 0
        return v, s

    fold.prefill = prefill_fold
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


PREFILL_DIMS = (32, 64, 128)  # fp4_prefill_fold: the prefill kernel's head dims


def _gen() -> torch.Generator:
    """A CPU generator seeded from the global one (fresh_seed)."""
    return torch.Generator().manual_seed(int(torch.randint(2**31, ())))


def _wide_weights(shape, dtype, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Weights over a wide range (normal values times 2^-70 .. 2^70, cast to dtype), with zeros of both signs and,
    where the shape allows, +-inf, a NaN, a float32 subnormal and 3e38: products that round among the subnormals,
    overflow or stay NaN."""
    w = torch.randn(shape, generator=g) * torch.pow(2.0, torch.randint(-70, 71, shape, generator=g).float())
    flat = w.view(-1)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, -1.5, 2.0 ** -130])
    n = min(flat.numel(), special.numel())
    flat[:n] = special[:n]
    return w.to(dtype).to(device)


def _prefill_expected(codes, sf, w=None):
    """What the ops computed before fp4_prefill_fold: the torch fold, then w.float() * exp2_int(base) (k: the
    scale alone)."""
    v, b = quant.fold_fp4_to_e4m3_torch(codes, sf)
    scale = quant.exp2_int(b)
    return v, (scale if w is None else w.float() * scale)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN matches any NaN."""
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    na, nb = a.isnan(), b.isnan()
    return a.shape == b.shape and torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


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


@pytest.mark.parametrize("d", PREFILL_DIMS)
def test_prefill_lane_logic_on_host_matches_the_torch_fold(host_fold, d, fresh_seed):
    """fp4_prefill_fold_kernel's per-lane steps (keys, their max, each lane's fold, the scale product) on the
    host against the torch fold and w * exp2_int(base), on random bytes and any exponent byte."""
    g = _gen()
    codes, sf = _random_rows(5000, d, g)
    w = _wide_weights((5000,), torch.float32, g)
    v, scale = host_fold.prefill(codes, sf, w)
    tv, tscale = _prefill_expected(codes, sf, w)
    assert torch.equal(v, _bits(tv))
    assert _same_floats(scale, tscale)
    _, k_scale = host_fold.prefill(codes, sf, torch.ones(5000))  # k: w = 1
    assert torch.equal(k_scale, _prefill_expected(codes, sf)[1])


def test_prefill_lane_logic_on_host_every_byte_at_every_shift(host_fold):
    rows, words = [], []
    for s in range(-40, 7):
        for byte in range(256):
            row = torch.zeros(32, dtype=torch.uint8)
            row[:16] = 0x77
            row[16:] = byte
            rows.append(row)
            words.append((200, 194 + s, 127, 127))
    codes, sf = torch.stack(rows), _words(words)
    w = _wide_weights((codes.shape[0],), torch.float32, torch.Generator().manual_seed(0))
    v, scale = host_fold.prefill(codes, sf, w)
    tv, tscale = _prefill_expected(codes, sf, w)
    assert torch.equal(v, _bits(tv)) and _same_floats(scale, tscale)


@pytest.mark.parametrize("op,d,max_regs", [("fp4_fold", d, 128) for d in DIMS] +
                         [("fp4_prefill_fold", d, 64) for d in PREFILL_DIMS])
def test_variant_compiles_without_spills(isolated_cache, op, d, max_regs):
    r = _C.precompile_variant(op, {"head_dim": d}, "sm_90a")
    assert r["params"] == f"{op}<head_dim={d}>"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, r
    assert 0 < r["registers"] <= max_regs, r


def test_prefill_variants_registered():
    assert [dict(v.params)["head_dim"] for v in jit.variants(ops=["fp4_prefill_fold"])] == list(PREFILL_DIMS)
    assert "fp4_prefill_fold" in jit.OPS
    with pytest.raises(ValueError, match="head_dim must be 32, 64 or 128"):
        _C.precompile_variant("fp4_prefill_fold", {"head_dim": 96}, "sm_90a")


def test_prefill_validation_messages():
    op = "deep_indexer.fp4_prefill_fold"
    q = torch.zeros(4, 16, 64, dtype=torch.uint8)
    q_sf = torch.zeros(4, 16, dtype=torch.int32)
    w = torch.zeros(4, 16)
    k = torch.zeros(9, 64, dtype=torch.uint8)
    k_sf = torch.zeros(9, dtype=torch.int32)
    f = _C.fp4_prefill_fold
    with pytest.raises(ValueError, match=f"{op}: pass both codes and scale words of an operand, or neither"):
        f(q, None, w, k, k_sf)
    with pytest.raises(ValueError, match=f"{op}: pass both codes and scale words"):
        f(None, None, None, None, k_sf)
    with pytest.raises(ValueError, match=f"{op}: q_codes must have dtype Byte or Char, got Float"):
        f(q.float(), q_sf, w, k, k_sf)
    with pytest.raises(ValueError, match=f"{op}: q_codes must be 3-D"):
        f(q[0], q_sf, w, k, k_sf)
    with pytest.raises(ValueError, match=r"q_codes must have D / 2 bytes per row with D in 32/64/128 .*\[4, 16, 48\]"):
        f(q[..., :48], q_sf, w, k, k_sf)
    with pytest.raises(ValueError, match=rf"{op}: q_sf must have dtype Int"):
        f(q, q_sf.long(), w, k, k_sf)
    with pytest.raises(ValueError, match=r"q_sf must have shape \[4, 16\] \(one scale word per row\), got \[3, 16\]"):
        f(q, q_sf[:3], w, k, k_sf)
    with pytest.raises(ValueError, match=f"{op}: k_codes must be 2-D"):
        f(None, None, None, q, q_sf)
    with pytest.raises(ValueError, match=f"{op}: q_codes must be on a CUDA device"):
        f(q, q_sf, w, k, k_sf)
    with pytest.raises(ValueError, match=f"{op}: k_codes must be on a CUDA device"):
        f(None, None, None, k.view(torch.int8), k_sf)


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


def _extreme_rows():
    """(codes, scale words) on the CPU: every code byte at every shift -40..6 of its group against the row's
    largest, next to exponent bytes 0 and 255."""
    rows, words = [], []
    for s in range(-40, 7):
        for byte in range(256):
            row = torch.zeros(64, dtype=torch.uint8)
            row[:16] = 0x7F
            row[16:48] = byte
            rows.append(row)
            words.append((200, 194 + s, 255, (byte & 1) * 255))
    return torch.stack(rows), _words(words)


@requires_sm90
def test_kernel_extreme_exponents_and_spans():
    """Exponent bytes 0 / 255 and spans far beyond 14 (inexact rows), every code byte at every shift."""
    codes, sf = (t.cuda() for t in _extreme_rows())
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


# ------------------------------------------------------------------------------------ GPU: fp4_prefill_fold
def _weights_in(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w [S, H] as a contiguous, row-padded or column-major tensor of the same values."""
    if layout == "padded":
        out = torch.empty(w.shape[0], w.shape[1] + 3, dtype=w.dtype, device=w.device)[:, : w.shape[1]]
    elif layout == "transposed":
        out = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device).t()
    else:
        return w.contiguous()
    out.copy_(w)
    return out


def _poisoned_outs(s_len: int, heads: int, skv: int, d: int) -> tuple:
    """NaN-filled (q, weights, k, k_scale) outputs (0xFF is an e4m3 NaN)."""
    full = lambda shape: torch.full(shape, 0xFF, dtype=torch.uint8, device="cuda")
    return (full((s_len, heads, d)).view(FP8), torch.full((s_len, heads), float("nan"), device="cuda"),
            full((skv, d)).view(FP8), torch.full((skv,), float("nan"), device="cuda"))


def _check_prefill_fold(got, q, q_sf, w, k, k_sf):
    if q is not None:
        tv, tw = _prefill_expected(q, q_sf, w)
        assert got[0].dtype == FP8 and got[0].shape == tv.shape and got[1].dtype == torch.float32
        assert torch.equal(_bits(got[0]), _bits(tv)), "q values"
        assert _same_floats(got[1], tw), "scaled weights"
    else:
        assert got[0] is None and got[1] is None
    if k is not None:
        kv, ks = _prefill_expected(k, k_sf)
        assert got[2].dtype == FP8 and got[2].shape == kv.shape and got[3].shape == ks.shape
        assert torch.equal(_bits(got[2]), _bits(kv)), "k values"
        assert torch.equal(got[3], ks), "k_scale"
    else:
        assert got[2] is None and got[3] is None


@requires_sm90
@pytest.mark.parametrize("d", PREFILL_DIMS)
@pytest.mark.parametrize("s_len,heads,skv", [(0, 64, 5), (1, 16, 1), (7, 32, 333), (300, 64, 4097), (2049, 128, 70001)])
def test_prefill_fold_kernel_matches_the_torch_fold(d, s_len, heads, skv, fresh_seed):
    """Random code bytes and scale words (any exponent byte, zero and sign-only rows and groups), weights of
    every dtype and layout over a wide range, into poisoned outputs and fresh ones, uint8 and int8 codes."""
    g = _gen()
    qc, qs = _random_rows(s_len * heads, d, g, "cuda")
    q, q_sf = qc.view(s_len, heads, d // 2), qs.view(s_len, heads)
    k, k_sf = _random_rows(skv, d, g, "cuda")
    for wdtype, layout, code_dtype in ((torch.float32, "contiguous", torch.uint8), (torch.bfloat16, "padded", torch.int8),
                                       (torch.float16, "transposed", torch.uint8), (torch.float32, "transposed", torch.int8),
                                       (torch.bfloat16, "contiguous", torch.uint8)):
        w = _weights_in(_wide_weights((s_len, heads), wdtype, g, "cuda"), layout)
        outs = _poisoned_outs(s_len, heads, skv, d)
        got = _C.fp4_prefill_fold(q.view(code_dtype), q_sf, w, k.view(code_dtype), k_sf, *outs)
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, outs))
        _check_prefill_fold(got, q, q_sf, w, k, k_sf)
        _check_prefill_fold(_C.fp4_prefill_fold(q, q_sf, w, k, k_sf), q, q_sf, w, k, k_sf)


@requires_sm90
def test_prefill_fold_extreme_exponents_zero_rows_and_spans():
    """Every code byte at every shift -40..6 with exponent bytes 0 / 255 next to it, rows of +-0 codes with
    scale words 0 and 0xFFFFFFFF (base -6 and 249: subnormal and huge scales), through q and k."""
    codes, sf = _extreme_rows()
    zero = torch.zeros(64, 64, dtype=torch.uint8)
    zero[1::2] = 0x88  # -0 codes
    zsf = torch.zeros(64, dtype=torch.int32)
    zsf[32:] = -1  # every exponent byte 255
    codes, sf = torch.cat([codes, zero]).cuda(), torch.cat([sf, zsf]).cuda()
    heads = 16
    q, q_sf = codes.view(-1, heads, 64), sf.view(-1, heads)
    for wdtype in (torch.float32, torch.bfloat16, torch.float16):
        w = _wide_weights(q_sf.shape, wdtype, torch.Generator().manual_seed(1), "cuda")
        w[-4:] = torch.tensor([[1.0], [-3.0], [65504.0], [1e-7]], dtype=wdtype, device="cuda")  # the zero rows' tokens
        outs = _poisoned_outs(q.shape[0], heads, codes.shape[0], 128)
        got = _C.fp4_prefill_fold(q, q_sf, w, codes, sf, *outs)
        _check_prefill_fold(got, q, q_sf, w, codes, sf)
    rv, rb, _ = quant.fp4_to_e4m3_folded(codes.cpu(), sf.cpu())  # the definition, float64
    assert torch.equal(_bits(got[2]).cpu(), _bits(rv)) and torch.equal(got[3].cpu(), quant.exp2_int(rb))


@requires_sm90
def test_prefill_fold_one_operand_and_unequal_dims(fresh_seed):
    """q alone, k alone, and q and k of different D (two launches; the prefill kernel then rejects them)."""
    g = _gen()
    qc, qs = _random_rows(50 * 32, 64, g, "cuda")
    q, q_sf = qc.view(50, 32, 32), qs.view(50, 32)
    k, k_sf = _random_rows(999, 128, g, "cuda")
    w = _wide_weights((50, 32), torch.float32, g, "cuda")
    _check_prefill_fold(_C.fp4_prefill_fold(q, q_sf, w, None, None), q, q_sf, w, None, None)
    _check_prefill_fold(_C.fp4_prefill_fold(None, None, None, k, k_sf), None, None, None, k, k_sf)
    _check_prefill_fold(_C.fp4_prefill_fold(q, q_sf, w, k, k_sf), q, q_sf, w, k, k_sf)
    assert _C.fp4_prefill_fold(None, None, None, None, None) == (None, None, None, None)


@requires_sm90
def test_prefill_fold_any_code_layout_and_output_checks(fresh_seed):
    """Non-contiguous codes and scale words and an unaligned start are copied first; bad outputs are refused."""
    g = _gen()
    d, s_len, heads = 128, 37, 16
    qc, qs = _random_rows(s_len * heads, d, g, "cuda")
    qt, qst = qc.view(heads, s_len, d // 2).transpose(0, 1), qs.view(heads, s_len).t()  # [S, H, D / 2], strided
    k, k_sf = _random_rows(300, d, g, "cuda")
    buf = torch.zeros(k.numel() + 16, dtype=torch.uint8, device="cuda")
    ku = buf[1: 1 + k.numel()].view(k.shape)
    ku.copy_(k)
    w = _wide_weights((s_len, heads), torch.bfloat16, g, "cuda")
    _check_prefill_fold(_C.fp4_prefill_fold(qt, qst, w, ku, k_sf), qt, qst, w, k, k_sf)
    op = "deep_indexer.fp4_prefill_fold"
    outs = list(_poisoned_outs(s_len, heads, 300, d))
    with pytest.raises(ValueError, match=f"{op}: an FP4 q needs its weights"):
        _C.fp4_prefill_fold(qt, qst, None, ku, k_sf)
    with pytest.raises(ValueError, match=rf"{op}: weights must have dtype Float or BFloat16 or Half, got Int"):
        _C.fp4_prefill_fold(qt, qst, w.int(), ku, k_sf)
    with pytest.raises(ValueError, match=rf"{op}: weights must have shape \[37, 16\]"):
        _C.fp4_prefill_fold(qt, qst, w[:, :8], ku, k_sf)
    with pytest.raises(ValueError, match=f"{op}: weights must be on cuda"):
        _C.fp4_prefill_fold(qt, qst, w.cpu(), ku, k_sf)
    with pytest.raises(ValueError, match=f"{op}: q_sf must be on cuda"):
        _C.fp4_prefill_fold(qt, qst.cpu(), w, ku, k_sf)
    with pytest.raises(ValueError, match=rf"{op}: q_out must have shape \[37, 16, 128\], got \[37, 16, 64\]"):
        _C.fp4_prefill_fold(qt, qst, w, ku, k_sf, outs[0][..., :64].contiguous(), *outs[1:])
    with pytest.raises(ValueError, match=f"{op}: weights_out must have dtype Float"):
        _C.fp4_prefill_fold(qt, qst, w, ku, k_sf, outs[0], outs[1].bfloat16(), *outs[2:])
    with pytest.raises(ValueError, match=f"{op}: k_out must be contiguous"):
        _C.fp4_prefill_fold(qt, qst, w, ku, k_sf, *outs[:2], torch.empty(d, 300, dtype=torch.uint8, device="cuda").t()
                            .view(FP8), outs[3])
    unaligned = torch.empty(300 * d + 16, dtype=torch.uint8, device="cuda")[1: 1 + 300 * d].view(300, d).view(FP8)
    with pytest.raises(ValueError, match=f"{op}: k_out must start at a 16-byte aligned address"):
        _C.fp4_prefill_fold(qt, qst, w, ku, k_sf, *outs[:2], unaligned, outs[3])
    with pytest.raises(ValueError, match=rf"{op}: k_scale_out must have shape \[300\], got \[299\]"):
        _C.fp4_prefill_fold(qt, qst, w, ku, k_sf, *outs[:3], outs[3][1:])


@requires_sm90
def test_prefill_fold_on_the_current_stream_and_in_a_cuda_graph(fresh_seed):
    g = _gen()
    d, s_len, heads, skv = 128, 256, 64, 4096
    qc, qs = _random_rows(s_len * heads, d, g, "cuda")
    q, q_sf = qc.view(s_len, heads, d // 2), qs.view(s_len, heads)
    k, k_sf = _random_rows(skv, d, g, "cuda")
    w = _wide_weights((s_len, heads), torch.float32, g, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _C.fp4_prefill_fold(q, q_sf, w, k, k_sf)  # (also loads the kernel before the capture)
    torch.cuda.current_stream().wait_stream(side)
    _check_prefill_fold(got, q, q_sf, w, k, k_sf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _C.fp4_prefill_fold(q, q_sf, w, k, k_sf)
    qc2, qs2 = _random_rows(s_len * heads, d, g, "cuda")
    k2, k_sf2 = _random_rows(skv, d, g, "cuda")
    for dst, src in ((qc, qc2), (qs, qs2), (k, k2), (k_sf, k_sf2)):
        dst.copy_(src)
    w.copy_(_wide_weights((s_len, heads), torch.float32, g, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    _check_prefill_fold(out, q, q_sf, w, k, k_sf)

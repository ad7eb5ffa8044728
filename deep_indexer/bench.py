"""`python -m deep_indexer bench`: the benchmark shapes (docs/performance.md), timed against ceilings measured in the same run.

Method: inputs are drawn once per shape; before every timed call the L2 is flushed by writing a
buffer twice its size (`--flush write`, the default of every recorded result; the dirty lines it
leaves are written back while the timed call runs) or by reading one (`--flush read`: a clean, cold
L2); each call is timed with CUDA events; the median of `--iters` calls is reported. Decode shapes
also get the logits and metadata kernels' own GPU durations (CUPTI through torch.profiler, same
flush, median), taken after every event timing (a profiler pass slows later launches). Ceilings:
device-to-device copy (bytes read + written) and an 8192^3 fp8 GEMM through torch._scaled_mm.
Prefill reports TFLOPS = 2 * valid pairs * H * D / time; decode reports GB/s
over q + weights + (D + 4) B per key token + 4 B per block-table entry + 4 B per valid logit
(FP4 decode: D / 2 + 4 B per key token and per q head), and its roofline: the larger of those bytes
at the copy rate and 2 * next_n * H * D FLOPs per key token at the fp8 GEMM rate.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

import deep_indexer as di

from . import _env, ops
from .quant import per_token_cast_to_fp4, per_token_cast_to_fp8

PREFILL_SHAPES = {  # id: (S, SKV, pattern)
    "P1": (2048, 8192, "causal"),
    "P2": (4096, 32768, "causal"),
    "P3": (4096, 65536, "causal"),
    "P4": (4096, 16384, "cp"),
    "P5": (8192, 131072, "causal"),
}
# FP4 prefill inputs (q and kv in DeepGEMM's FP4 form, folded into e4m3 before the FP8 kernel): "<P id>-FP4",
# timed in turn with the FP8 call of the same shape (target: within 5% of it).
FP4_PREFILL_SHAPES = [f"{sid}-FP4" for sid in PREFILL_SHAPES]
# Compressed logits (max_seqlen_k > 0): id: (prefill shape id, max_seqlen_k). P2c is P2 with a
# [S, SKV] compressed output (the longest causal row is SKV - 1 keys): same work, compare with P2.
COMPRESSED_SHAPES = {"P2c": ("P2", 32768)}
DECODE_SHAPES = {  # id: (B, next_n, avg context)
    "D1": (1, 1, 32768),
    "D2": (64, 1, 8192),
    "D3": (64, 2, 32768),
    "D4": (128, 1, 32768),
    "D5": (256, 1, 8192),
    "D6": (64, 3, 32768),
    "D7": (64, 4, 32768),
    "D8": (256, 1, 65536),
    "D9": (64, 8, 32768),  # next_n = 8 (7 speculative tokens)
}
# Varlen decode (indices): id: (requests, rows per request, avg context). The same work as the decode
# shape (requests, rows, avg) but as one q row per token, each run of a request's rows reading the
# block-table row of its first row (the other rows hold -1).
VARLEN_SHAPES = {
    "V1": (64, 4, 32768),
}
# FP4 decode inputs (q and the paged cache in DeepGEMM's FP4 form, 68 bytes per key at D = 128): "<D or V id>-FP4",
# timed in turn with the FP8 call of the same shape.
FP4_DECODE_SHAPES = [f"{sid}-FP4" for sid in (*DECODE_SHAPES, *VARLEN_SHAPES)]
# clean_logits alone: id: (rows, columns) of fp32 logits with random key ranges.
CLEAN_SHAPES = {"C1": (4096, 131072)}


# Top-k over fp32 logits (docs/topk.md): id: (rows, avg valid keys, pattern, k). "decode": row
# lengths U[0.7, 1.3] x avg (one row: exactly avg); "causal": rows = S, SKV = avg, ke[i] = SKV - S + i.
TOPK_SHAPES = {
    "K-D1": (1, 32768, "decode", 2048),
    "K-D2": (64, 8192, "decode", 2048),
    "K-D3": (128, 32768, "decode", 2048),
    "K-D5": (256, 8192, "decode", 2048),
    "K-D8": (256, 65536, "decode", 2048),
    "K-V4F": (256, 8192, "decode", 512),
    "K-V4P": (256, 8192, "decode", 1024),
    "K-V4F-1K": (1024, 8192, "decode", 512),
    "K-V4F-P2": (4096, 32768, "causal", 512),
    "K-V4F-C8K": (4096, 8192, "causal", 512),
    "K-C4K": (4096, 4096, "causal", 2048),
    "K-P2": (4096, 32768, "causal", 2048),
    "K-P3": (4096, 65536, "causal", 2048),
    "K-P5": (8192, 131072, "causal", 2048),
}


# Logits -> top-k in one call (fp8_paged_mqa_topk_indices / fp8_mqa_topk_indices, k = 2048 unless
# noted) against the logits alone (clean_logits=False): "KF-<decode or prefill id>[:k]". KF-D5:512 /
# KF-D5:1024 are the DeepSeek-V4 decode steps (256 sequences of ~8K compressed entries = ~32K tokens,
# k = 512 Flash / 1024 Pro).
def fused_topk_ids() -> list:
    return ([f"KF-{d}" for d in ("D1", "D2", "D3", "D4", "D5", "D8")] + ["KF-D5:512", "KF-D5:1024"] +
            ["KF-P2", "KF-P2:512", "KF-P3", "KF-P5"])


def fused_topk_fp4_ids() -> list:
    """The fused rows on FP4 inputs ("<KF id>-FP4"; KF-D5:512-FP4 / KF-D5:1024-FP4: the V4 decode steps)."""
    return [f"{sid}-FP4" for sid in fused_topk_ids()]


def shape_groups() -> dict:
    """The --shapes group names and their ids."""
    return {"prefill": list(PREFILL_SHAPES) + list(COMPRESSED_SHAPES), "decode": list(DECODE_SHAPES) + list(VARLEN_SHAPES),
            "clean": list(CLEAN_SHAPES), "prefill_fp4": FP4_PREFILL_SHAPES,
            "decode_fp4": FP4_DECODE_SHAPES + [i for i in fused_topk_fp4_ids() if i.startswith("KF-D")],
            "topk": list(TOPK_SHAPES), "fused_topk": fused_topk_ids(), "fused_topk_fp4": fused_topk_fp4_ids()}


def topk_case(sid: str, device, seed: int) -> dict:
    """fp32 logits of a TOPK_SHAPES id: clean (-inf outside the ranges, for torch.topk) and padded rows."""
    rows, avg, pattern, k = TOPK_SHAPES[sid]
    gen = torch.Generator(device=device).manual_seed(seed)
    if pattern == "decode":
        lens = (avg * (0.7 + 0.6 * torch.rand(rows, generator=gen, device=device))).to(torch.int32)
        if rows == 1:
            lens.fill_(avg)
        ks, ke = None, lens
    else:
        ke = (avg - rows + 1 + torch.arange(rows, device=device)).to(torch.int32)
        ks = torch.zeros(rows, dtype=torch.int32, device=device)
    n = int(ke.max())
    stride = (n + 63) // 64 * 64
    logits = torch.randn(rows, stride, generator=gen, device=device)[:, :n]
    col = torch.arange(n, device=device)
    for r0 in range(0, rows, 1024):
        logits[r0:r0 + 1024].masked_fill_(col[None, :] >= ke[r0:r0 + 1024, None].long(), float("-inf"))
    valid = int(ke.long().clamp(max=n).sum())
    return {"logits": logits, "ks": ks, "ke": ke, "k": k, "valid_bytes": 4 * valid, "rows": rows, "n": n,
            "shape": f"{rows} x {n} ({pattern}, {valid / rows:.0f} valid keys/row) k={k}"}


def topk_run(x: dict, out=None, lib=None):
    """A call of `lib`.topk_indices (default deep_indexer) on a topk_case's logits."""

    lib = di if lib is None else lib
    return lambda: lib.topk_indices(x["logits"], x["k"], x["ks"], x["ke"], **({} if out is None else {"out": out}))


def decode_shape(spec: str) -> tuple:
    """(B, next_n, avg context, H) of a decode shape id (D1..D9, H = 64) or of 'B:next_n:avg[:H]'."""
    if spec in DECODE_SHAPES:
        return (*DECODE_SHAPES[spec], 64)
    parts = [int(v) for v in spec.split(":")]
    if len(parts) not in (3, 4):
        raise ValueError(f"decode shape must be D1..D9 or B:next_n:avg[:H], got {spec!r}")
    return tuple(parts) if len(parts) == 4 else (*parts, 64)


# The anchor: DeepGEMM on H200 / H100, microseconds, at H = 64, D = 128, float32 logits (None: not measured).
ANCHOR_US = {
    "P1": (232, 233), "P2": (1840, 1820), "P3": (4195, 4030), "P4": (578, 606), "P5": (17098, 16127),
    "D1": (7.1, 7.8), "D2": (26.6, 34.8), "D3": (87.1, 116), "D4": (153, 216), "D5": (82.1, 114),
}
# Other head counts / dims: {(H, D): {id: (H200, H100)}}; DeepGEMM's kernel timed by the bench's method
# (docs/performance.md, "side by side with DeepGEMM, every head count and dim").
ANCHOR_US_HD = {
    (32, 64): {"P1": (116, 116), "P2": (848, 822), "P3": (1779, 1722), "P4": (288, 299), "P5": (7057, 6922)},
    (32, 128): {"P1": (143, 144), "P2": (1055, 1065), "P3": (2393, 2381), "P4": (353, None), "P5": (9578, 9337)},
    (64, 64): {"P1": (189, 189), "P2": (1450, 1465), "P3": (3063, 3053), "P4": (455, 464), "P5": (12601, 12869)},
}


def anchor_us(sid: str, heads: int, head_dim: int, logits_dtype: str, col: int):
    """DeepGEMM's time for this shape on this device kind (col 0: H200, 1: H100), or None."""
    if logits_dtype != "float32":
        return None
    table = ANCHOR_US if (heads, head_dim) == (64, 128) else ANCHOR_US_HD.get((heads, head_dim), {})
    return table.get(sid, (None, None))[col]


def source_commit() -> str:
    """The commit measured, or "" when it cannot be known.

    DI_BENCH_COMMIT when set (for a copied tree without its .git); else, when this package's folder is
    part of a git checkout of deep_indexer (its parent folder is the work tree's root, as with
    `pip install -e .`), that checkout's HEAD, with "+changes" when tracked files differ from it.
    An installed copy (site-packages) has no commit to report: "".
    """
    if os.environ.get(_env.BENCH_COMMIT):
        return os.environ[_env.BENCH_COMMIT]
    pkg = os.path.dirname(os.path.abspath(__file__))

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=pkg, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or os.path.realpath(top.stdout.strip()) != os.path.realpath(os.path.dirname(pkg)):
            return ""  # not a checkout, or the package sits inside some other repository
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        if not head:
            return ""
        dirty = git("diff", "--quiet", "HEAD", "--").returncode == 1
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def default_output_dir() -> str:
    """Where the bench writes its JSON and chart unless told: $XDG_CACHE_HOME/deep_indexer/bench
    (default ~/.cache/deep_indexer/bench), beside the kernel cache but not in it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deep_indexer", "bench")


def shape_help() -> str:
    """The shape ids, read from the tables above (for --help)."""
    def nk(v):
        return f"{v // 1024}K" if v % 1024 == 0 else str(v)

    lines = ["shapes (H = 64, D = 128, fp32 logits, 64-token blocks unless --heads/--head-dim/... say otherwise):"]
    lines += [f"  {i:<11} prefill: S={S}, SKV={SKV}, {'causal' if pat == 'causal' else 'context-parallel'}"
              for i, (S, SKV, pat) in PREFILL_SHAPES.items()]
    lines += [f"  {i:<11} {base} with compressed logits (max_seqlen_k = {m})" for i, (base, m) in COMPRESSED_SHAPES.items()]
    lines += ["  " + " ".join(FP4_PREFILL_SHAPES)]
    lines += ["              the prefill shape with FP4 q and kv (DeepGEMM's FP4 form), timed against its FP8 call"]
    lines += [f"  {i:<11} clean_logits on [{M}, {N}] fp32 logits, random key ranges" for i, (M, N) in CLEAN_SHAPES.items()]
    lines += [f"  {i:<11} decode: B={B}, next_n={nn}, average context {avg}" for i, (B, nn, avg) in DECODE_SHAPES.items()]
    lines += [f"  {i:<11} varlen decode: {B} requests x {nn} rows (indices), average context {avg}"
              for i, (B, nn, avg) in VARLEN_SHAPES.items()]
    lines += ["  " + " ".join(FP4_DECODE_SHAPES)]
    lines += ["              the decode shape with FP4 q and an FP4 paged cache (D / 2 + 4 bytes per key), timed",
              "              against its FP8 call; GB/s over the FP4 bytes and x the roofline"]
    lines += [f"  {i:<11} top-k: {rows} x ~{nk(avg)} keys ({pat} rows), k={k}" for i, (rows, avg, pat, k) in TOPK_SHAPES.items()]
    lines += ["  " + " ".join(fused_topk_ids())]
    lines += ["              logits + top-k in one call against the logits alone (KF-<shape>[:k], k = 2048 unless given)"]
    lines += ["  " + " ".join(fused_topk_fp4_ids())]
    lines += ["              the same on FP4 inputs (KF-D5:512-FP4 / KF-D5:1024-FP4: DeepSeek-V4-Flash / -Pro decode steps)"]
    lines += ["  groups: prefill, prefill_fp4, decode, decode_fp4 (D*-FP4, V1-FP4, KF-D*-FP4), clean, topk, fused_topk,",
              "          fused_topk_fp4 (default: prefill decode clean topk)",
              "  custom: B:next_n:avg[:H] (decode), S:SKV:causal|cp[:H[:D[:max_seqlen_k]]] (prefill)"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = ("Times the benchmark shapes (cold L2, median of --iters CUDA-event timings of the whole call) "
                     "next to the device's copy bandwidth and fp8 GEMM rate measured in the same run. Needs an SM90 GPU.")
    p.epilog = (shape_help() + "\n\noutput: the table on stdout; JSON and a PNG chart in --out-dir (default "
                "$XDG_CACHE_HOME/deep_indexer/bench, i.e. ~/.cache/deep_indexer/bench), named "
                "<date>-<device>[-<commit>]; --json / --png PATH write exactly there, '' skips the file.")
    p.add_argument("--shapes", nargs="+", default=None, metavar="ID",
                   help="shape ids or groups (listed below; default: prefill decode clean topk)")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--logits-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-kv", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out-dir", default=None,
                   help="folder for the JSON and chart (default: $XDG_CACHE_HOME/deep_indexer/bench)")
    p.add_argument("--json", default=None, help="results file (default: in --out-dir; '' to skip)")
    p.add_argument("--png", default=None, help="chart of the fraction of ceiling per shape (default: in --out-dir; '' to skip)")
    p.add_argument("--compare", default=None, help="an importable module with the same API, run side by side")
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring the ceilings")
    p.add_argument("--no-kernel-time", action="store_true", help="skip the CUPTI kernel durations of decode shapes")
    p.add_argument("--flush", choices=("write", "read"), default="write",
                   help="L2 flush before each timed call: write a buffer twice the L2 (default) or read one")
    p.add_argument("--host-slack-us", type=float, default=100.0,
                   help="GPU-side wait (us) queued after the flush, before the start event, so that a slow host has "
                        "submitted the timed call before the GPU reaches it (0: none)")


class Timer:
    """Cold-L2 median timing with CUDA events."""

    def __init__(self, device: torch.device, flush: str = "write", host_slack_us: float = 100.0):
        if flush not in ("write", "read"):
            raise ValueError(f"flush must be 'write' or 'read', got {flush!r}")
        if host_slack_us < 0:
            raise ValueError(f"host_slack_us must be >= 0, got {host_slack_us}")
        props = torch.cuda.get_device_properties(device)
        self.flush = flush
        # A host slower than the flush (a loaded machine: the empty kernel measured 7-11 us instead
        # of 3 on some) leaves the GPU idle between the start event and the timed kernel, and that
        # idle time was counted (D4 160 vs 146 us, D1 20.7 vs 7.5 on one such machine); the slack
        # covers it and changed nothing on a normal host. torch.cuda._sleep counts SM
        # cycles: 2 GHz is above any Hopper clock, so the wait lasts at least host_slack_us.
        self.slack_cycles = int(host_slack_us * 2000)
        self.flush_buf = torch.ones(2 * props.L2_cache_size // 4 + 1024, dtype=torch.float32, device=device)
        self.flush_sink = torch.empty((), dtype=torch.float32, device=device)

    def flush_l2(self) -> None:
        if self.flush == "write":
            self.flush_buf.fill_(1.0)
        else:  # a read of twice the L2: evicts (and writes back) what is there, leaves clean lines
            torch.sum(self.flush_buf, dim=0, out=self.flush_sink)

    def __call__(self, fn: Callable[[], object], iters: int, warmup: int = 3, warm_s: float = 0.05) -> float:
        # Short calls (< 0.2 ms: decode) get `warm_s` of back-to-back calls first: after an idle gap
        # (a JIT compile, say) the GPU clocks are low and a few microsecond-scale calls do not bring
        # them back up. Long calls get `warmup` calls only: tens of ms of prefill at full tilt reach
        # the board's power cap, which lowers the clocks by ~10% (measured on H200: P2 1853-1902 us
        # vs 1990-2090 us).
        self.warm(fn, warmup, warm_s)
        return statistics.median(self.times(fn, iters))

    def warm(self, fn: Callable[[], object], warmup: int = 3, warm_s: float = 0.05) -> None:
        fn()  # may compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        short = time.perf_counter() - t0 < 2e-4
        t0, n = time.perf_counter(), 2
        while n < warmup or (short and time.perf_counter() - t0 < warm_s):
            fn()
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()

    def alternated(self, fns: list, iters: int) -> list:
        """Median times (us) of several calls timed in turn, one of each per round (each after a
        flush), so that clock and power drift over the run affect them alike: for ratios."""
        for fn in fns:
            self.warm(fn)
        times = [[] for _ in fns]
        for _ in range(iters):
            for t, fn in zip(times, fns):
                t.extend(self.times(fn, 1))
        return [statistics.median(t) for t in times]

    def times(self, fn: Callable[[], object], iters: int, after: Optional[Callable[[], object]] = None) -> list:
        """Event times (us) of `iters` calls, each after a flush (and the slack); `after()` runs on the
        host after each call has finished. No warm-up."""
        out = []
        for _ in range(iters):
            self.flush_l2()
            if self.slack_cycles:
                torch.cuda._sleep(self.slack_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
            if after is not None:
                after()
        return out


def kernel_durations(fn: Callable, timer: Timer, iters: int, match: str, before: Optional[Callable] = None,
                     sync_each: bool = False) -> list:
    """GPU durations (us, CUPTI through torch.profiler) of the kernels whose name contains `match`,
    over `iters` calls of fn, each after an L2 flush (and `before()`, if given; a synchronize after each
    call with sync_each). Run it after all event timings of a process: once the profiler has run,
    launches are slower (the host can fall behind the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            timer.flush_l2()
            if before is not None:
                before()
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    return [e.time_range.elapsed_us() for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and match in e.name]


def measure_ceilings(timer: Timer, device: torch.device) -> dict:
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src), iters=20)
    src = dst = None  # free 2 GiB before the GEMM
    m = 8192
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    gemm_us = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=20)
    # The floor of any single op timed this way: one (near-)empty kernel, same cold-L2 method.
    launch_us = timer(lambda: torch.cuda._sleep(0), iters=50)
    return {"copy_GBps": 2 * n / copy_us / 1e3, "fp8_gemm_TFLOPS": 2 * m**3 / gemm_us / 1e6,
            "empty_kernel_us": launch_us}


def prefill_inputs(S: int, SKV: int, pattern: str, H: int, D: int, device) -> dict:

    q = torch.randn(S, H, D, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    k, k_scale = per_token_cast_to_fp8(torch.randn(SKV, D, device=device, dtype=torch.bfloat16))
    w = torch.randn(S, H, device=device, dtype=torch.float32)
    i = torch.arange(S, device=device, dtype=torch.int64)
    if pattern == "causal":
        ke = SKV - S + i
    else:  # context-parallel pattern (docs/performance.md)
        half, cp = S // 2, SKV // S
        idx = cp // 3
        ke = torch.where(i < half, idx * half + i, (2 * cp - 1 - idx) * half + (i - half))
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    ke = ke.clamp(0, SKV).to(torch.int32)
    pairs = int((ke.to(torch.int64) - ks.to(torch.int64)).clamp(min=0).sum())
    return {"q": q, "kv": (k, k_scale), "weights": w, "ks": ks, "ke": ke, "pairs": pairs}


def roofline_us(x: dict, ceil: dict):
    """The decode floor of decode_inputs `x` (us): its bytes at the copy rate or its FLOPs at the fp8 GEMM rate,
    whichever takes longer (None without ceilings)."""
    if not ceil:
        return None
    return max(x["bytes"] / ceil["copy_GBps"] / 1e3, x["flops"] / ceil["fp8_gemm_TFLOPS"] / 1e6)


def decode_inputs(B: int, next_n: int, avg: int, H: int, D: int, block_kv: int, device, seed: int = 0,
                  fp4: bool = False) -> dict:
    """Decode inputs: lengths U[0.7, 1.3] x avg, blocks scattered at random, random keys. fp4: q as (q_fp4, q_sf)
    and the FP4 paged cache (D / 2 + 4 bytes per key), with the same lengths and block table as for the seed's
    FP8 inputs. "bytes": what must move; "flops": 2 * next_n * H * D per key token."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = (torch.rand(B, generator=g) * 0.6 + 0.7).mul(avg).to(torch.int32).clamp(min=next_n)
    blocks = (lens + block_kv - 1) // block_kv
    max_blocks = int(blocks.max())
    num_blocks = int(blocks.sum())
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    off = 0
    for b in range(B):
        n = int(blocks[b])
        table[b, :n] = perm[off:off + n]
        off += n
    if fp4:
        cache = torch.randint(0, 255, (num_blocks, block_kv, 1, D // 2 + 4), dtype=torch.uint8, device=device)
        # random codes (every nibble is an e2m1 code), then scale words: exponents near 1.0, padded with 127
        e = torch.randint(118, 128, (num_blocks, block_kv, 4), dtype=torch.uint8, device=device)
        e[..., D // 32:] = 127
        cache.view(num_blocks, -1)[:, block_kv * D // 2:] = e.view(num_blocks, -1)
        q = per_token_cast_to_fp4(torch.randn(B, next_n, H, D, device=device))
        q_bytes, key_bytes = B * next_n * H * (D // 2 + 4), D // 2 + 4
    else:
        cache = torch.randint(0, 255, (num_blocks, block_kv, 1, D + 4), dtype=torch.uint8, device=device)
        # valid fp32 scales in each block's tail
        scales = torch.rand(num_blocks, block_kv, device=device) * 0.02 + 0.001
        cache.view(num_blocks, -1)[:, block_kv * D:] = scales.view(torch.uint8).view(num_blocks, -1)
        fp8 = cache.view(num_blocks, -1)[:, : block_kv * D]
        fp8.copy_(torch.randn(num_blocks, block_kv * D, device=device).to(torch.float8_e4m3fn).view(torch.uint8))
        q = torch.randn(B, next_n, H, D, device=device).to(torch.float8_e4m3fn)
        q_bytes, key_bytes = q.numel(), D + 4
    w = torch.randn(B * next_n, H, device=device)
    ctx = lens.to(device)
    valid = int(sum(max(0, int(l) - next_n + i + 1) for l in lens for i in range(next_n)))
    nbytes = q_bytes + w.numel() * 4 + int(lens.sum()) * key_bytes + num_blocks * 4 + valid * 4
    return {"q": q, "kv_cache": cache, "weights": w, "context_lens": ctx, "block_table": table.to(device),
            "max_context_len": int(lens.max()), "bytes": nbytes, "flops": 2 * next_n * H * D * int(lens.sum())}


def varlen_inputs(requests: int, rows: int, avg: int, H: int, D: int, block_kv: int, device, seed: int = 0,
                  fp4: bool = False) -> dict:
    """decode_inputs(requests, rows, ...) recast as a varlen batch of requests * rows q rows."""
    x = decode_inputs(requests, rows, avg, H, D, block_kv, device, seed, fp4)
    R = requests * rows
    q = x["q"]
    q = (q[0].reshape(R, 1, H, D // 2), q[1].reshape(R, 1, H)) if fp4 else q.reshape(R, 1, H, D)
    j = torch.arange(rows, device=device)
    ctx = (x["context_lens"][:, None] - rows + 1 + j).reshape(R).to(torch.int32)
    table = torch.full((R, x["block_table"].shape[1]), -1, dtype=torch.int32, device=device)
    table[::rows] = x["block_table"]
    ids = torch.arange(requests, dtype=torch.int32, device=device).repeat_interleave(rows)
    return {**x, "q": q, "context_lens": ctx, "block_table": table, "indices": ids}


def prefill_shape(spec: str) -> tuple:
    """(S, SKV, pattern, H, D) of a prefill shape id (P1..P5, P2c; H = 64, D = 128) or of
    'S:SKV:pattern[:H[:D[:max_seqlen_k]]]'."""
    if spec in COMPRESSED_SHAPES:
        spec = COMPRESSED_SHAPES[spec][0]
    if spec in PREFILL_SHAPES:
        return (*PREFILL_SHAPES[spec], 64, 128)
    parts = spec.split(":")
    if len(parts) not in (3, 4, 5, 6) or parts[2] not in ("causal", "cp"):
        raise ValueError(f"prefill shape must be P1..P5, P2c or S:SKV:causal|cp[:H[:D[:max_seqlen_k]]], got {spec!r}")
    rest = [int(v) for v in parts[3:5]]
    return (int(parts[0]), int(parts[1]), parts[2], *(rest + [64, 128][len(rest):]))


def prefill_max_seqlen_k(spec: str) -> int:
    """max_seqlen_k of a prefill shape (0: full-width logits)."""
    if spec in COMPRESSED_SHAPES:
        return COMPRESSED_SHAPES[spec][1]
    parts = spec.split(":")
    return int(parts[5]) if len(parts) == 6 else 0


def is_prefill_shape(spec: str) -> bool:
    """Whether `spec` names a prefill shape (P1..P5, P2c or S:SKV:pattern[...]) rather than a decode one
    (D1..D9, B:next_n:avg[:H], either with an "-FP4" suffix)."""
    return (spec in PREFILL_SHAPES or spec in COMPRESSED_SHAPES or
            (spec.count(":") >= 2 and not spec.removesuffix("-FP4").split(":")[2].isdigit()))


def prefill_case(spec: str, device) -> tuple:
    """Inputs of a prefill shape (see prefill_shape) and a call of fp8_mqa_logits (fp32, clean) on them."""

    S, SKV, pattern, H, D = prefill_shape(spec)
    m = prefill_max_seqlen_k(spec)
    x = prefill_inputs(S, SKV, pattern, H, D, device)
    return x, lambda: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True, max_seqlen_k=m)


def decode_case(spec: str, device) -> tuple:
    """Inputs of a decode shape (see decode_shape; D = 128, block 64; "<id>-FP4": FP4 q and cache) and a call
    of the logits op on them with their schedule (for the tools: profiling, timelines, side-by-side runs)."""
    fp4 = spec.endswith("-FP4")
    B, nn, avg, H = decode_shape(spec[:-4] if fp4 else spec)
    x = decode_inputs(B, nn, avg, H, 128, 64, device, fp4=fp4)
    return x, decode_call(x)


def decode_call(x: dict):
    """A call of the logits op (fp32, no clean) on decode_inputs `x`, with a schedule computed now
    (under the current environment: experiment builds of the metadata kernel differ)."""

    meta = di.get_paged_mqa_logits_metadata(x["context_lens"], 64)
    return lambda: di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], x["context_lens"],
                                           x["block_table"], meta, x["max_context_len"], False)


def fused_decode_call(x: dict, k: int):
    """The fused decode op (metadata + logits + top-k) on decode_inputs `x` as the bench times it: the
    schedule computed in every call, a workspace and output reused. Returns (call, workspace)."""

    q = x["q"][0] if isinstance(x["q"], tuple) else x["q"]  # (FP4: the codes)
    dev = q.device
    rows = q.shape[0] * q.shape[1]
    block_kv = x["kv_cache"].shape[1]
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws = di.topk_workspace(rows, x["max_context_len"], device=dev)
    out = torch.empty(rows, k, dtype=torch.int32, device=dev)

    def call():
        meta = di.get_paged_mqa_logits_metadata(x["context_lens"], block_kv, num_sms)
        return di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], x["context_lens"], x["block_table"],
                                             meta, x["max_context_len"], k, workspace=ws, out=out)
    return call, ws


def fused_decode_case(spec: str, device) -> tuple:
    """Inputs of a fused decode shape 'KF-<D1..D9>[:k][-FP4]' (H = 64, D = 128, block 64, k = 2048 unless
    given; -FP4: FP4 q and cache) and a call of the fused op on them (for the tools). Returns (x, k, call)."""
    fp4 = spec.endswith("-FP4")
    base, _, kk = spec[3: len(spec) - 4 * fp4].partition(":")
    if not spec.startswith("KF-") or base not in DECODE_SHAPES:
        raise ValueError(f"fused decode shape must be KF-<D1..D9>[:k][-FP4], got {spec!r}")
    B, nn, avg, H = decode_shape(base)
    x = decode_inputs(B, nn, avg, H, 128, 64, device, fp4=fp4)
    k = int(kk) if kk else 2048
    return x, k, fused_decode_call(x, k)[0]


def run(args) -> dict:

    if not torch.cuda.is_available():
        raise SystemExit("bench: no CUDA GPU is visible; the benchmark needs an SM90 (Hopper) GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        raise SystemExit(f"bench: {torch.cuda.get_device_name(device)} is sm_{cc[0]}{cc[1]}; the kernels need SM90 (Hopper)")
    name = torch.cuda.get_device_name(device)
    anchor_col = 0 if "H200" in name else 1
    other = importlib.import_module(args.compare) if args.compare else None
    timer = Timer(device, args.flush, args.host_slack_us)
    wanted = args.shapes or ["prefill", "decode", "clean", "topk"]
    ids = []
    groups = shape_groups()
    for s in wanted:
        ids += groups.get(s, [s])
    print(f"device: {name} ({torch.cuda.get_device_properties(device).multi_processor_count} SMs)", flush=True)
    ceil = {} if args.no_ceilings else measure_ceilings(timer, device)
    if ceil:
        print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, fp8 GEMM {ceil['fp8_gemm_TFLOPS']:.0f} TFLOPS, "
              f"empty kernel {ceil['empty_kernel_us']:.1f} us", flush=True)
    H, D = args.heads, args.head_dim
    out_dtype = getattr(torch, args.logits_dtype)
    rows = []
    kernel_time = []  # (row, logits call, metadata call) of decode shapes, for the CUPTI pass at the end
    for n, sid in enumerate(ids):
        print(f"[{n + 1}/{len(ids)}] {sid} ...", file=sys.stderr, flush=True)
        torch.manual_seed(n)
        if sid in PREFILL_SHAPES or sid in COMPRESSED_SHAPES:
            S, SKV, pat = PREFILL_SHAPES[COMPRESSED_SHAPES[sid][0] if sid in COMPRESSED_SHAPES else sid]
            max_k = prefill_max_seqlen_k(sid)
            x = prefill_inputs(S, SKV, pat, H, D, device)
            extra = {"logits_dtype": out_dtype} if out_dtype != torch.float32 else {}
            if max_k:
                extra["max_seqlen_k"] = max_k  # other modules (--compare) may not take it: only when used
            call = lambda m: m.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True, **extra)
            us = timer(lambda: call(di), args.iters)
            tflops = 2 * x["pairs"] * H * D / us / 1e6
            frac = tflops / ceil["fp8_gemm_TFLOPS"] if ceil else None
            r = {"id": sid, "kind": "prefill", "shape": f"S={S} SKV={SKV} {pat} H={H} D={D} {args.logits_dtype}"
                 + (f" max_seqlen_k={max_k}" if max_k else ""),
                 "us": us, "TFLOPS": tflops, "fraction_of_ceiling": frac}
            if other is not None:
                r["compare_us"] = timer(lambda: call(other), args.iters)
            del x
        elif sid in FP4_PREFILL_SHAPES:

            S, SKV, pat = PREFILL_SHAPES[sid[:-4]]
            x = prefill_inputs(S, SKV, pat, H, D, device)
            q4 = per_token_cast_to_fp4(torch.randn(S, H, D, device=device, dtype=torch.bfloat16))
            kv4 = per_token_cast_to_fp4(torch.randn(SKV, D, device=device, dtype=torch.bfloat16))
            kw = {"logits_dtype": out_dtype}
            fp4 = lambda x=x, q4=q4, kv4=kv4: di.fp8_mqa_logits(q4, kv4, x["weights"], x["ks"], x["ke"], True, **kw)
            fp8 = lambda x=x: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True, **kw)
            us, fp8_us = timer.alternated([fp4, fp8], args.iters)  # in turn: the same clocks for both
            fold_us = timer(lambda x=x, q4=q4, kv4=kv4: ops._prefill_inputs("bench", q4, kv4, x["weights"]), args.iters)
            tflops = 2 * x["pairs"] * H * D / us / 1e6
            r = {"id": sid, "kind": "prefill_fp4", "shape": f"S={S} SKV={SKV} {pat} H={H} D={D} {args.logits_dtype} FP4",
                 "us": us, "TFLOPS": tflops, "fraction_of_ceiling": tflops / ceil["fp8_gemm_TFLOPS"] if ceil else None,
                 "fp8_us": fp8_us, "over_fp8": us / fp8_us, "fold_us": fold_us}
            del x, q4, kv4
        elif sid in DECODE_SHAPES or sid in VARLEN_SHAPES:
            varlen = sid in VARLEN_SHAPES
            B, nn, avg = VARLEN_SHAPES[sid] if varlen else DECODE_SHAPES[sid]
            x = (varlen_inputs if varlen else decode_inputs)(B, nn, avg, H, D, args.block_kv, device, seed=n)
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            kw = {"indices": x["indices"]} if varlen else {}
            meta = di.get_paged_mqa_logits_metadata(x["context_lens"], args.block_kv, num_sms, **kw)
            call = lambda m, meta=meta, x=x, kw=kw: m.fp8_paged_mqa_logits(
                x["q"], x["kv_cache"], x["weights"], x["context_lens"], x["block_table"], meta, x["max_context_len"], False,
                **kw)
            meta_call = lambda x=x, num_sms=num_sms, kw=kw: di.get_paged_mqa_logits_metadata(
                x["context_lens"], args.block_kv, num_sms, **kw)
            us = timer(lambda: call(di), args.iters)
            meta_us = timer(meta_call, args.iters)
            gbps = x["bytes"] / us / 1e3
            frac = gbps / ceil["copy_GBps"] if ceil else None
            shape = (f"varlen {B} requests x {nn} rows" if varlen else f"B={B} next_n={nn}") + \
                f" avg={avg} H={H} D={D} block={args.block_kv}"
            floor = roofline_us(x, ceil)
            r = {"id": sid, "kind": "decode", "shape": shape,
                 "us": us, "GBps": gbps, "fraction_of_ceiling": frac, "metadata_us": meta_us,
                 "floor_us": floor, "over_floor": us / floor if floor else None}
            if other is not None and not varlen:  # (the reference implementation has no varlen on SM90)
                ometa = other.get_paged_mqa_logits_metadata(x["context_lens"], args.block_kv, num_sms)
                r["compare_us"] = timer(lambda: call(other, ometa), args.iters)
            if not args.no_kernel_time:
                kernel_time.append((r, lambda call=call: call(di), meta_call))
            del x
        elif sid in FP4_DECODE_SHAPES:
            base = sid[:-4]
            varlen = base in VARLEN_SHAPES
            B, nn, avg = VARLEN_SHAPES[base] if varlen else DECODE_SHAPES[base]
            make = varlen_inputs if varlen else decode_inputs
            x = make(B, nn, avg, H, D, args.block_kv, device, seed=n, fp4=True)
            x8 = make(B, nn, avg, H, D, args.block_kv, device, seed=n)  # the same lengths and block table, FP8
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            kw = {"indices": x["indices"]} if varlen else {}
            meta = di.get_paged_mqa_logits_metadata(x["context_lens"], args.block_kv, num_sms, **kw)
            calls = [lambda xi=xi, meta=meta, kw=kw: di.fp8_paged_mqa_logits(
                xi["q"], xi["kv_cache"], xi["weights"], xi["context_lens"], xi["block_table"], meta,
                xi["max_context_len"], False, **kw) for xi in (x, x8)]
            us, fp8_us = timer.alternated(calls, args.iters)  # in turn: the same clocks for both
            gbps = x["bytes"] / us / 1e3
            floor = roofline_us(x, ceil)
            shape = (f"varlen {B} requests x {nn} rows" if varlen else f"B={B} next_n={nn}") + \
                f" avg={avg} H={H} D={D} block={args.block_kv} FP4"
            r = {"id": sid, "kind": "decode_fp4", "shape": shape, "us": us, "GBps": gbps,
                 "fraction_of_ceiling": gbps / ceil["copy_GBps"] if ceil else None, "fp8_us": fp8_us,
                 "over_fp8": us / fp8_us, "floor_us": floor, "over_floor": us / floor if floor else None}
            if not args.no_kernel_time:
                kernel_time.append((r, calls[0], lambda x=x, num_sms=num_sms, kw=kw: di.get_paged_mqa_logits_metadata(
                    x["context_lens"], args.block_kv, num_sms, **kw)))
            del x, x8
        elif sid in CLEAN_SHAPES:
            M, N = CLEAN_SHAPES[sid]
            logits = torch.randn(M, N, device=device)
            ks = torch.randint(0, N // 2, (M,), device=device, dtype=torch.int32)
            ke = (ks + torch.randint(0, N // 2, (M,), device=device, dtype=torch.int32)).to(torch.int32)
            written = int((N - (ke - ks).clamp(min=0)).sum()) * 4
            us = timer(lambda: di.clean_logits(logits, ks, ke), args.iters)
            gbps = written / us / 1e3
            r = {"id": sid, "kind": "clean_logits", "shape": f"[{M}, {N}] float32, random ranges",
                 "us": us, "GBps": gbps, "fraction_of_ceiling": gbps / ceil["copy_GBps"] if ceil else None}
            del logits
        elif sid in TOPK_SHAPES:
            x = topk_case(sid, device, seed=n)
            out = torch.empty(x["rows"], x["k"], dtype=torch.int32, device=device)
            call = topk_run(x, out)
            us = timer(call, args.iters)
            torch_us = timer(lambda x=x: torch.topk(x["logits"], x["k"], dim=1, sorted=False), max(5, args.iters // 3))
            floor = x["valid_bytes"] / ceil["copy_GBps"] / 1e3 if ceil else None
            gbps = x["valid_bytes"] / us / 1e3
            r = {"id": sid, "kind": "topk", "shape": x["shape"], "us": us, "GBps": gbps,
                 "fraction_of_ceiling": gbps / ceil["copy_GBps"] if ceil else None, "floor_us": floor,
                 "over_floor": us / floor if floor else None, "torch_topk_us": torch_us,
                 "speedup_vs_torch_topk": torch_us / us}
            if other is not None and hasattr(other, "topk_indices"):
                r["compare_us"] = timer(topk_run(x, lib=other), args.iters)
            del x, out
        elif sid.startswith("KF-"):
            fp4 = sid.endswith("-FP4")  # FP4 q and kv (decode: the FP4 paged cache)
            base, _, kk = sid[3: len(sid) - 4 * fp4].partition(":")
            k = int(kk) if kk else 2048
            if base in DECODE_SHAPES:
                B, nn, avg = DECODE_SHAPES[base]
                x = decode_inputs(B, nn, avg, H, D, args.block_kv, device, seed=n, fp4=fp4)
                num_sms = torch.cuda.get_device_properties(device).multi_processor_count
                fused, ws = fused_decode_call(x, k)

                def logits_only(x=x, ws=ws, num_sms=num_sms):
                    meta = di.get_paged_mqa_logits_metadata(x["context_lens"], args.block_kv, num_sms)
                    return di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], x["context_lens"],
                                                   x["block_table"], meta, x["max_context_len"], False, out=ws)
                shape = f"B={B} next_n={nn} avg={avg} H={H} D={D} k={k} (metadata included)" + (" FP4" if fp4 else "")
            elif base in PREFILL_SHAPES:
                S, SKV, pat = PREFILL_SHAPES[base]
                x = prefill_inputs(S, SKV, pat, H, D, device)
                if fp4:
                    x["q"] = per_token_cast_to_fp4(torch.randn(S, H, D, device=device, dtype=torch.bfloat16))
                    x["kv"] = per_token_cast_to_fp4(torch.randn(SKV, D, device=device, dtype=torch.bfloat16))
                out = torch.empty(S, k, dtype=torch.int32, device=device)
                fused = lambda x=x, out=out, k=k: di.fp8_mqa_topk_indices(x["q"], x["kv"], x["weights"], x["ks"], x["ke"],
                                                                          k, out=out)
                logits_only = lambda x=x: di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], False)
                shape = f"S={S} SKV={SKV} {pat} H={H} D={D} k={k}" + (" FP4" if fp4 else "")
            else:
                raise SystemExit(f"bench: unknown shape id '{sid}'")
            # Timed in turn: the fused call first and the logits after it (as before) favoured the
            # logits alone, which ran on a GPU already at its power cap (P2: 1.16x instead of 1.26-1.39x)
            us, base_us = timer.alternated([fused, logits_only], args.iters)
            r = {"id": sid, "kind": "fused_topk", "shape": shape, "us": us, "logits_us": base_us,
                 "over_logits": us / base_us, "GBps": 0.0, "fraction_of_ceiling": None}
            del x
        else:
            raise SystemExit(f"bench: unknown shape id '{sid}'")
        anc = anchor_us(sid, H, D, args.logits_dtype, anchor_col)
        if anc is not None:
            r["anchor_us"] = anc
            r["speedup_vs_anchor"] = anc / r["us"]
        rows.append(r)
        torch.cuda.empty_cache()
    for r, logits_fn, meta_fn in kernel_time:
        for key, fn, match in (("kernel_us", logits_fn, "paged_mqa_logits_kernel"),
                               ("metadata_kernel_us", meta_fn, "paged_mqa_metadata_kernel")):
            ks = kernel_durations(fn, timer, args.iters, match)
            if ks:
                r[key] = statistics.median(ks)
    commit = source_commit()
    return {"device": name, "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
            "host": platform.node(), "flush": args.flush, "host_slack_us": args.host_slack_us, "ceilings": ceil,
            "compare": args.compare, "results": rows}


def print_table(res: dict) -> None:
    print(f"\n{'id':<4} {'shape':<52} {'time us':>10} {'rate':>14} {'of ceil':>8} {'anchor':>9} {'speedup':>8}")
    for r in res["results"]:
        rate = f"{r['TFLOPS']:.0f} TFLOPS" if "TFLOPS" in r else f"{r['GBps']:.0f} GB/s" if r.get("GBps") else "-"
        frac = f"{r['fraction_of_ceiling']:.2f}" if r.get("fraction_of_ceiling") is not None else "-"
        anc = f"{r['anchor_us']:.1f}" if "anchor_us" in r else "-"
        sp = f"{r['speedup_vs_anchor']:.2f}x" if "speedup_vs_anchor" in r else "-"
        extra = f"  (metadata {r['metadata_us']:.1f} us)" if "metadata_us" in r else ""
        if "logits_us" in r:
            extra += f"  (logits alone {r['logits_us']:.1f} us: {r['over_logits']:.2f}x)"
        if "torch_topk_us" in r:
            fl = (f"floor {r['floor_us']:.1f} us, {r['over_floor']:.2f}x of it; " if r.get("floor_us") else "")
            extra += f"  ({fl}torch.topk {r['torch_topk_us']:.1f} us, {r['speedup_vs_torch_topk']:.1f}x faster)"
        if "fp8_us" in r:
            fold = f"; the fold alone {r['fold_us']:.1f} us" if "fold_us" in r else ""
            extra += f"  (FP8 {r['fp8_us']:.1f} us: FP4 {r['over_fp8']:.3f}x of it{fold})"
        if r.get("floor_us") and "torch_topk_us" not in r:
            extra += f"  (roofline {r['floor_us']:.1f} us: {r['over_floor']:.2f}x)"
        if "kernel_us" in r:
            extra += f"  (kernels alone: logits {r['kernel_us']:.1f} us, metadata {r.get('metadata_kernel_us', 0):.1f} us)"
        cmp = (f"  ({res.get('compare')}: {r['compare_us']:.1f} us; deep_indexer {r['compare_us'] / r['us']:.2f}x as fast)"
               if "compare_us" in r else "")
        print(f"{r['id']:<4} {r['shape']:<52} {r['us']:>10.1f} {rate:>14} {frac:>8} {anc:>9} {sp:>8}{extra}{cmp}")


def draw(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed; no chart", file=sys.stderr)
        return
    rs = [r for r in res["results"] if r.get("fraction_of_ceiling") is not None]
    fig, ax = plt.subplots(figsize=(max(6, len(rs) * 0.8), 4))
    ax.bar([r["id"] for r in rs], [r["fraction_of_ceiling"] for r in rs],
           color=["tab:blue" if r["kind"].startswith("prefill") else "tab:orange" for r in rs])
    ax.set_ylabel("fraction of measured ceiling")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"deep_indexer on {res['device']}" + (f" ({res['commit']})" if res.get("commit") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def output_paths(res: dict, args) -> tuple:
    """(json path, png path) of a run; '' where the file is skipped (see add_arguments)."""
    stem = "-".join(x for x in (res["date"], "".join(c if c.isalnum() else "_" for c in res["device"]).strip("_"),
                                res.get("commit", "")) if x)
    out_dir = args.out_dir or default_output_dir()
    paths = []
    for value, ext in ((getattr(args, "json", None), "json"), (getattr(args, "png", None), "png")):
        paths.append(os.path.join(out_dir, f"{stem}.{ext}") if value is None else value)
    return tuple(paths)


def main(args) -> int:
    res = run(args)
    print_table(res)
    json_path, png_path = output_paths(res, args)
    for path in (json_path, png_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {json_path}")
    if png_path:
        draw(res, png_path)
        if os.path.exists(png_path):
            print(f"wrote {png_path}")
    return 0

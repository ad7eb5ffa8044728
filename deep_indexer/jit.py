"""Ahead-of-time compilation and the on-disk kernel cache.

`precompile()` compiles every requested kernel variant in parallel (no GPU needed when `arch` is
given) so that serving never compiles; `cache_info()` / `cache_clear()` inspect the cache.
The first call of each op in a process still loads its cubin from the cache (milliseconds): warm
up before capturing CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Optional, Sequence

import deep_indexer._C as _C

# Supported compile-time values per op: the C++ extension's table (_C.variant_space(), python_api.cpp),
# which also parses and validates each variant.
_SPACE = _C.variant_space()
HEADS = tuple(_SPACE["heads"])
MQA_HEAD_DIMS = tuple(_SPACE["mqa_head_dims"])
PAGED_HEAD_DIMS = tuple(_SPACE["paged_head_dims"])
FP4_HEAD_DIMS = tuple(_SPACE["fp4_head_dims"])  # fp4_fold (FP4 q / kv folded into e4m3, docs/fp4.md)
FP4_PREFILL_HEAD_DIMS = tuple(_SPACE["fp4_prefill_head_dims"])  # fp4_prefill_fold (the prefill ops' FP4 inputs)
TRAINING_HEAD_DIMS = tuple(_SPACE["training_head_dims"])  # bf16 training kernels (deep_indexer.training)
NEXT_N = tuple(_SPACE["next_n"])
BLOCK_KV = tuple(_SPACE["block_kv"])
# decode input forms by name: (q_fp4, kv_fp4) of paged_mqa_logits (FP8 or FP4 q, FP8 or FP4 paged cache)
_FORM_NAMES = {(0, 0): "fp8", (1, 1): "fp4", (0, 1): "fp8q-fp4kv", (1, 0): "fp4q-fp8kv"}
PAGED_INPUTS = {_FORM_NAMES[tuple(f)]: tuple(f) for f in _SPACE["paged_input_forms"]}
_ELEM_BYTES = dict(_SPACE["logits_elem_bytes"])
LOGITS_DTYPES = tuple(_ELEM_BYTES)
TRAINING_TARGET_HEAD_DIMS = tuple(_SPACE["training_target_head_dims"])  # attention q.k dims precompiled for the warm-up target
OPS = tuple(_SPACE["ops"])
# (attention q.k dim, indexer dim) pairs precompiled for the warm-up loss's per_head target (others compile on use)
TRAINING_PER_HEAD_DIMS = tuple(tuple(p) for p in _SPACE["training_per_head_dims"])
# the resident top-k forms: (cluster, threads, CTAs per SM, most keys per thread for float32, for bfloat16)
# (TopkResidentLayout::max_keys_per_thread)
_TOPK_RESIDENT_FORMS = tuple(tuple(f) for f in _SPACE["topk_resident_forms"])


@dataclasses.dataclass(frozen=True)
class Variant:
    op: str
    params: tuple  # sorted (key, value) pairs passed to _C.precompile_variant

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params)


def _check_choice(name: str, values: Iterable, allowed: Sequence) -> list:
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"precompile: unsupported {name} {bad}; supported: {list(allowed)}")
    return values


def variants(
    ops: Optional[Sequence[str]] = None,
    heads: Optional[Sequence[int]] = None,
    head_dims: Optional[Sequence[int]] = None,
    next_n: Optional[Sequence[int]] = None,
    block_kv: Optional[Sequence[int]] = None,
    logits_dtypes: Optional[Sequence[str]] = None,
    paged_inputs: Optional[Sequence[str]] = None,
) -> list[Variant]:
    """Every kernel variant of the chosen ops over the chosen options (None = all supported). paged_inputs:
    the decode input forms (names of PAGED_INPUTS: "fp8", "fp4", "fp8q-fp4kv", "fp4q-fp8kv")."""
    ops = _check_choice("op", ops or OPS, OPS)
    forms = [PAGED_INPUTS[f] for f in _check_choice("paged input form", paged_inputs or PAGED_INPUTS, list(PAGED_INPUTS))]
    dtypes = _check_choice("logits dtype", logits_dtypes or LOGITS_DTYPES, LOGITS_DTYPES)
    hs = _check_choice("head count", heads or HEADS, HEADS)
    nn = _check_choice("next_n", next_n or NEXT_N, NEXT_N)
    bk = _check_choice("block_kv", block_kv or BLOCK_KV, BLOCK_KV)
    if head_dims:
        _check_choice("head dim", head_dims, sorted(set(MQA_HEAD_DIMS) | set(PAGED_HEAD_DIMS) | set(TRAINING_HEAD_DIMS)
                                                    | set(TRAINING_TARGET_HEAD_DIMS) | set(FP4_HEAD_DIMS)))
    out: list[Variant] = []

    def add(op: str, **params):
        out.append(Variant(op, tuple(sorted(params.items()))))

    for op in ops:
        if op == "clean_logits":
            for dt in dtypes:
                add(op, elem_bytes=_ELEM_BYTES[dt])
        elif op == "mqa_logits":
            dims = [d for d in (head_dims or MQA_HEAD_DIMS) if d in MQA_HEAD_DIMS]
            for h, d, dt in itertools.product(hs, dims, dtypes):
                add(op, num_heads=h, head_dim=d, elem_bytes=_ELEM_BYTES[dt])
        elif op == "paged_mqa_logits":
            dims = [d for d in (head_dims or PAGED_HEAD_DIMS) if d in PAGED_HEAD_DIMS]
            for (q4, kv4), n, h, d, b, dt, two_d in itertools.product(forms, nn, hs, dims, bk, dtypes, (0, 1)):
                fp4 = {k: 1 for k, on in (("q_fp4", q4), ("kv_fp4", kv4)) if on}  # (FP8 variants: as before)
                add(op, next_n=n, num_heads=h, head_dim=d, block_kv=b, elem_bytes=_ELEM_BYTES[dt], context_lens_2d=two_d,
                    **fp4)
                if n == 1:  # varlen (indices) variants exist for next_n = 1 only
                    add(op, next_n=n, num_heads=h, head_dim=d, block_kv=b, elem_bytes=_ELEM_BYTES[dt],
                        context_lens_2d=two_d, varlen=1, **fp4)
        elif op == "paged_mqa_logits_metadata":
            for n, small in itertools.product(nn, (1, 0)):
                add(op, next_n=n, small=small)
        elif op == "topk":
            for dt, srt, cl, wide in itertools.product(dtypes, (0, 1), (0, 1), (0, 1)):
                if not (srt and cl):  # the cluster form is unsorted only
                    add(op, elem_bytes=_ELEM_BYTES[dt], sorted=srt, cluster=cl, wide=wide)
                if _ELEM_BYTES[dt] == 2 and not cl:  # bfloat16 rows of at most TopkLayout::kPackedMaxCols columns
                    add(op, elem_bytes=2, sorted=srt, cluster=0, wide=wide, packed=1)
            # the resident form (unsorted): the forms its heuristic takes (heuristics_sm90.hpp), whole
            # 16-byte vectors per thread up to the register budget (TopkResidentLayout::max_keys_per_thread)
            for dt, (cl, threads, per_sm, most4, most2) in itertools.product(dtypes, _TOPK_RESIDENT_FORMS):
                vec = 16 // _ELEM_BYTES[dt]
                many = {"ctas_per_sm": per_sm} if per_sm > 1 else {}  # (one CTA per SM: as before)
                for kpt in range(vec, (most4 if _ELEM_BYTES[dt] == 4 else most2) + 1, vec):
                    add(op, elem_bytes=_ELEM_BYTES[dt], resident=1, keys_per_thread=kpt, cluster=cl, threads=threads,
                        **many)
        elif op in ("training_logits", "training_logits_stats"):
            dims = [d for d in (head_dims or TRAINING_HEAD_DIMS) if d in TRAINING_HEAD_DIMS]
            for h, d in itertools.product(hs, dims):
                add(op, num_heads=h, head_dim=d)
        elif op == "training_target":
            if heads and 128 not in heads:
                continue
            dims = [d for d in (head_dims or TRAINING_TARGET_HEAD_DIMS) if d in TRAINING_TARGET_HEAD_DIMS]
            for d, c, lse in itertools.product(dims, (1, 2), (0, 1)):
                add(op, head_dim=d, cluster=c, lse=lse)
        elif op in ("training_indexer_dk", "training_indexer_dq"):
            if heads and 64 not in heads:
                continue
            dims = [d for d in (head_dims or TRAINING_HEAD_DIMS) if d in TRAINING_HEAD_DIMS]
            for d in dims:  # the forms the ops use: the loss's (S recomputed), the logits backward's (sign mask)
                if op == "training_indexer_dk":
                    add(op, head_dim=d, loss=1, mask=0)
                    add(op, head_dim=d, loss=0, mask=1)
                else:
                    add(op, head_dim=d, masked=0, bf16_out=0)
                    add(op, head_dim=d, masked=1, bf16_out=1)
        elif op in ("training_per_head_rows", "training_per_head_dk"):
            for qk, d in TRAINING_PER_HEAD_DIMS:
                if head_dims and d not in head_dims:
                    continue
                if op == "training_per_head_rows":
                    for bwd in (0, 1):
                        add(op, qk_dim=qk, head_dim=d, bwd=bwd)
                else:
                    add(op, qk_dim=qk, head_dim=d)
        elif op in ("fp4_fold", "fp4_prefill_fold"):
            dims = FP4_HEAD_DIMS if op == "fp4_fold" else FP4_PREFILL_HEAD_DIMS
            for d in (head_dims or dims):
                if d in dims:
                    add(op, head_dim=d)
    return out


def resolve_arch(arch: Optional[str]) -> str:
    """`arch` if given (only sm_90a), else the current GPU's, with a clear error without one."""
    if arch:
        if arch != "sm_90a":
            raise ValueError(f"precompile: unsupported arch '{arch}'; the kernels target sm_90a (Hopper)")
        return arch
    ok, why = _C.driver_available()
    if not ok:
        raise RuntimeError(f"precompile: no GPU to detect the architecture from ({why}); pass --arch sm_90a")
    cc = _C.device_info(0)["cc"]
    if tuple(cc) != (9, 0):
        raise RuntimeError(f"precompile: cuda:0 has compute capability {cc[0]}.{cc[1]}; kernels need SM90 (pass --arch sm_90a to compile anyway)")
    return "sm_90a"


def precompile(
    ops: Optional[Sequence[str]] = None,
    heads: Optional[Sequence[int]] = None,
    head_dims: Optional[Sequence[int]] = None,
    next_n: Optional[Sequence[int]] = None,
    block_kv: Optional[Sequence[int]] = None,
    logits_dtypes: Optional[Sequence[str]] = None,
    arch: Optional[str] = None,
    jobs: Optional[int] = None,
    progress: Optional[Callable[[int, int, dict], None]] = None,
    paged_inputs: Optional[Sequence[str]] = None,
) -> list[dict]:
    """Compiles the chosen kernel variants into the disk cache, `jobs` nvcc processes at a time.

    Returns one dict per variant (kernel, params, registers, spill bytes, smem bytes, seconds,
    from_cache, or `error`). Never raises for a failed variant: check each dict's "error".
    paged_inputs: the decode input forms to compile (default: all of PAGED_INPUTS).
    """
    return compile_variants(variants(ops, heads, head_dims, next_n, block_kv, logits_dtypes, paged_inputs), arch, jobs,
                            progress)


def compile_variants(
    todo: Sequence[Variant],
    arch: Optional[str] = None,
    jobs: Optional[int] = None,
    progress: Optional[Callable[[int, int, dict], None]] = None,
) -> list[dict]:
    """precompile() of the given variants (from variants()), in their order."""
    arch = resolve_arch(arch)
    jobs = max(1, jobs or os.cpu_count() or 1)
    results: list[Optional[dict]] = [None] * len(todo)
    lock = threading.Lock()
    done = 0

    def one(i: int, v: Variant) -> None:
        nonlocal done
        t0 = time.perf_counter()
        try:
            r = _C.precompile_variant(v.op, dict(v.params), arch)
        except Exception as e:  # noqa: BLE001 - reported per variant
            r = {"kernel": v.op, "params": v.describe(), "error": str(e), "seconds": time.perf_counter() - t0}
        r["op"] = v.op
        results[i] = r
        with lock:
            done += 1
            if progress:
                progress(done, len(todo), r)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for f in as_completed([pool.submit(one, i, v) for i, v in enumerate(todo)]):
            f.result()
    return [r for r in results if r is not None]


def _entries(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def cache_info() -> dict:
    """Location, number of entries and total size of the on-disk kernel cache."""
    root = pathlib.Path(_C.cache_dir())
    entries = _entries(root)
    size = sum(f.stat().st_size for e in entries for f in e.iterdir() if f.is_file())
    return {"path": str(root), "entries": len(entries), "bytes": size}


def cache_clear() -> int:
    """Removes every cache entry (safe while other processes run: they recompile). Returns the count."""
    root = pathlib.Path(_C.cache_dir())
    entries = _entries(root)
    for e in entries:
        shutil.rmtree(e, ignore_errors=True)
    shutil.rmtree(root.parent / "tmp", ignore_errors=True)
    return len(entries)


def print_table(results: list[dict], file=sys.stdout) -> None:
    head = f"{'kernel':<26} {'parameters':<56} {'regs':>5} {'spills':>7} {'smem':>8} {'secs':>6} {'cache':>5}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in results:
        if "error" in r:
            print(f"{r['kernel']:<26} {r['params']:<56} FAILED: {r['error'].splitlines()[0][:200]}", file=file)
            continue
        spills = r["spill_stores"] + r["spill_loads"]
        print(f"{r['kernel']:<26} {r['params']:<56} {r['registers']:>5} {spills:>7} {r['smem_bytes']:>8} "
              f"{r['seconds']:>6.2f} {'hit' if r['from_cache'] else 'miss':>5}", file=file)

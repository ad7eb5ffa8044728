"""One tiny case of every op, for compute-sanitizer (tools/sanitize_check.sh), and the parser of its reports.

    python tools/sanitize_cases.py [--only NAME ...] [--list]      run the cases (CUDA, SM90)
    python tools/sanitize_cases.py --parse LOG --tool TOOL         one line per case: clean / N reports;
                                                                   exit 1 on a report not in SUPPRESSIONS

Each case prints "@@case NAME" before its calls and synchronizes after them, so every report the sanitizer
prints (memcheck at the launch or synchronization that finds it, racecheck / synccheck at the kernel's end)
lands in its case's section of the log. The shapes are the smallest that still reach each kernel's paths
(several pipeline stages, several CTAs, rows with no key): a sanitizer run costs ~100x the kernel time.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

# (tool, pattern over a report's text, why it is not a bug). A report is suppressed when the pattern matches
# it; keep each entry as narrow as the explanation.
#
# The training kernels' stage release: each consumer lane reads the stage (a header, per-row values, a partial
# sum), then __syncwarp() and lane 0 alone arrives on the stage's "empty" mbarrier (count: one per warp); the
# producer waits on it and refills the stage (generic stores, or cp.async.bulk in training_per_head_dk). Ordered:
# bar.warp.sync orders every lane's reads before lane 0's mbarrier.arrive (release.cta, cumulative), and the
# producer's try_wait (acquire) returns only after that arrival, so the refill follows every read. racecheck does
# not carry the __syncwarp hand-off into the arrival and reports each read against the next item's writes (WAR):
# tools/sanitize_repro.cu reproduces it in 80 lines (warp_arrive / warp_arrive_bulk reported, the same kernels
# with every lane arriving clean; H200, compute-sanitizer racecheck). Every racecheck report of these kernels at
# 39acb5e is this pair (reads: training_indexer_bwd.cuh make_ds / wait_item, training_per_head.cuh header and
# RowInfo reads, training_target.cuh reducer sum; writes: the producer's fill of the same stage one ring turn later).
_STAGE_RELEASE = "lane reads, __syncwarp, lane-0 arrive on the stage's empty mbarrier (tools/sanitize_repro.cu)"
_Q_SLOT_WRITE = r"(stage_q_rows\([^\n]*paged_mqa_logits|store_q_words<[^\n]*paged_fp4)\.cuh:\d+"
_Q_SLOT_READ = r"(math_warpgroups\([^\n]*paged_mqa_logits|build_pieces<[^\n]*split_relu)\.cuh:\d+"
SUPPRESSIONS: list[tuple[str, str, str]] = [
    ("racecheck", r"training_indexer_dk_kernel<.*training_indexer_bwd\.cuh", _STAGE_RELEASE),
    ("racecheck", r"training_per_head_dk_kernel<.*training_per_head\.cuh", _STAGE_RELEASE),
    ("racecheck", r"training_target_kernel<.*training_target\.cuh:\d+.*training_target\.cuh", _STAGE_RELEASE),
    # The prefill kernel's KV stage: every math lane reads the stage's k scales (written by the producer's 4-byte
    # cp.async, completion counted on the stage's full barrier by cp.async.mbarrier.arrive.noinc), then
    # __syncwarp() and lane 0 arrives on the stage's empty barrier: the same release (repro: warp_arrive_cp).
    ("racecheck", r"cp_async_4\(void \*, const void \*\)\+0x[0-9a-f]+ in ptx\.cuh:\d+.*mqa_logits_body<|mqa_logits_body<.*cp_async_4\(", _STAGE_RELEASE),
    # The decode kernel's q slot with FP4 inputs (staged q): the Q producer's lanes write the slot's rows and
    # scale its weights with generic stores, __syncwarp(), lane 0 arrives on q_full; every math lane reads the
    # weights after waiting on it, and hands the slot back by __syncwarp() and a lane-0 arrive on q_empty, which
    # the Q producer waits on before the slot's next generation: the same release both ways (the FP8 path fills
    # the slot by TMA, which racecheck does not track). Reports seen (H100): stage_q_rows' weights store against
    # take_generation's weights read; with split relu (next_n = 2, H200), store_q_words' q rows (in stage_q_rows)
    # against build_pieces' reads of them.
    ("racecheck", rf"access at [^\n]*{_Q_SLOT_WRITE}.*access at [^\n]*{_Q_SLOT_READ}|"
                  rf"access at [^\n]*{_Q_SLOT_READ}.*access at [^\n]*{_Q_SLOT_WRITE}", _STAGE_RELEASE),
]

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _env(**kv):
    """Sets the DI_* switches of one call (None: unset); returns the old values for _restore."""
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    return old


def _restore(old):
    _env(**old)


# ------------------------------------------------------------------------------------------------ inference ops


@case
def mqa_logits():
    import deep_indexer as di
    from deep_indexer.bench import prefill_inputs

    x = prefill_inputs(96, 2048, "causal", 64, 128, "cuda")  # 30+ KV tiles: the KV ring turns several times
    x["ks"][::7] = 50  # rows starting inside the keys, and an empty row
    x["ke"][5] = 0
    for dtype in (torch.float32, torch.bfloat16):
        di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True, logits_dtype=dtype)
    di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], False)


@case
def fp4_prefill():
    """The FP4 fold kernel (ragged row counts, D 64 and 128), the prefill fold (FP4 q and kv in one launch, ragged
    row counts, bf16 weights) and FP4 q and kv through the prefill logits."""
    import deep_indexer as di
    from deep_indexer import _C, quant
    from deep_indexer.bench import prefill_inputs

    for rows, d in ((1, 64), (333, 128), (4096, 64)):
        codes, sf = quant.per_token_cast_to_fp4(torch.randn(rows, d, device="cuda"))
        quant.fold_fp4_to_e4m3(codes, sf)
    for s_len, h, skv, d in ((1, 16, 1, 32), (37, 64, 333, 128), (5, 32, 4099, 64)):
        q = quant.per_token_cast_to_fp4(torch.randn(s_len, h, d, device="cuda"))
        k = quant.per_token_cast_to_fp4(torch.randn(skv, d, device="cuda"))
        _C.fp4_prefill_fold(*q, torch.randn(s_len, h, device="cuda").bfloat16(), *k)
    x = prefill_inputs(96, 2048, "causal", 64, 128, "cuda")
    q = quant.per_token_cast_to_fp4(torch.randn(96, 64, 128, device="cuda"))
    kv = quant.per_token_cast_to_fp4(torch.randn(2048, 128, device="cuda"))
    di.fp8_mqa_logits(q, kv, x["weights"], x["ks"], x["ke"], True)


@case
def mqa_logits_compressed():
    import deep_indexer as di
    from deep_indexer.bench import prefill_inputs

    x = prefill_inputs(96, 2048, "causal", 64, 128, "cuda")
    for dtype in (torch.float32, torch.bfloat16):
        di.fp8_mqa_logits(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], True, max_seqlen_k=128, logits_dtype=dtype)


def _decode(next_n, two_d=False, varlen=False, dtype=torch.float32):
    import deep_indexer as di
    from deep_indexer.bench import decode_inputs, varlen_inputs

    x = varlen_inputs(3, 2, 300, 64, 128, 64, "cuda") if varlen else decode_inputs(4, next_n, 300, 64, 128, 64, "cuda")
    ctx = x["context_lens"]
    if two_d:
        ctx = (ctx[:, None] - next_n + 1 + torch.arange(next_n, device="cuda")).to(torch.int32).contiguous()
    idx = x.get("indices")
    meta = di.get_paged_mqa_logits_metadata(ctx, 64, indices=idx)
    di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta, x["max_context_len"],
                            True, logits_dtype=dtype, indices=idx)
    return x, ctx, meta


@case
def metadata():
    import deep_indexer as di

    ctx = torch.tensor([1, 300, 0, 4000, 77], dtype=torch.int32, device="cuda")
    di.get_paged_mqa_logits_metadata(ctx, 64)
    di.get_paged_mqa_logits_metadata(torch.stack([ctx, ctx + 1], 1).contiguous(), 32)
    di.get_paged_mqa_logits_metadata(ctx, 64, indices=torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32, device="cuda"))


@case
def paged_mqa_logits():
    _decode(1)
    _decode(1, dtype=torch.bfloat16)


@case
def paged_mqa_logits_next_n():
    _decode(2)
    _decode(4, two_d=True)


@case
def paged_mqa_logits_varlen():
    _decode(1, varlen=True)


@case
def paged_mqa_logits_work_splits():
    """Both ways the decode kernel deals its work (DI_PAGED_TILE_SPLIT: the schedule's segments, tiles counted by
    the kernel), also one sequence of 40K keys (ranges starting and ending inside segments)."""
    import deep_indexer as di
    from deep_indexer.bench import decode_inputs

    long = decode_inputs(1, 1, 40000, 64, 128, 64, "cuda")
    for split in (0, 1):
        old = _env(DI_PAGED_TILE_SPLIT=split)
        try:
            _decode(1)
            _decode(2, two_d=True)
            meta = di.get_paged_mqa_logits_metadata(long["context_lens"], 64)
            di.fp8_paged_mqa_logits(long["q"], long["kv_cache"], long["weights"], long["context_lens"],
                                    long["block_table"], meta, long["max_context_len"], True)
        finally:
            _restore(old)


@case
def paged_mqa_logits_fp4():
    """FP4 q and cache (next_n 1, 2 with 2-D lengths, 32-token blocks), FP8 q with the FP4 cache, FP4 q with
    the FP8 cache."""
    import deep_indexer as di
    from deep_indexer.bench import decode_inputs

    for next_n, block_kv, two_d in ((1, 64, False), (2, 32, True)):
        x = decode_inputs(3, next_n, 300, 64, 128, block_kv, "cuda", fp4=True)
        ctx = x["context_lens"]
        if two_d:
            ctx = (ctx[:, None] - next_n + 1 + torch.arange(next_n, device="cuda")).to(torch.int32).contiguous()
        meta = di.get_paged_mqa_logits_metadata(ctx, block_kv)
        di.fp8_paged_mqa_logits(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                x["max_context_len"], True)
    x4 = decode_inputs(3, 1, 300, 64, 128, 64, "cuda", fp4=True)
    x8 = decode_inputs(3, 1, 300, 64, 128, 64, "cuda")
    for q, cache in ((x8["q"], x4["kv_cache"]), (x4["q"], x8["kv_cache"])):
        x = x4 if cache is x4["kv_cache"] else x8
        meta = di.get_paged_mqa_logits_metadata(x["context_lens"], 64)
        di.fp8_paged_mqa_logits(q, cache, x["weights"], x["context_lens"], x["block_table"], meta,
                                x["max_context_len"], False)


@case
def clean_logits():
    import deep_indexer as di

    ks = torch.tensor([0, 5, 100, -3], dtype=torch.int32, device="cuda")
    ke = torch.tensor([300, 5, 200, 1000], dtype=torch.int32, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        di.clean_logits(torch.zeros(8, 1000, dtype=dtype, device="cuda"), ks, ke, next_n=2)
        di.clean_logits(torch.zeros(4, 1000, dtype=dtype, device="cuda"), None, ke)


def _topk(k=256, **forced):
    import deep_indexer as di

    old = _env(**forced)
    try:
        gen = torch.Generator().manual_seed(1)
        m, n = 5, 40000
        x = torch.randn(m, n + 4, generator=gen)[:, 1:n + 1].cuda()
        ks = torch.tensor([0, 3, 100, 7, 0], dtype=torch.int32, device="cuda")
        ke = torch.tensor([n, n - 1, 300, 7, 12000], dtype=torch.int32, device="cuda")
        di.topk_indices(x, k, ks, ke, return_values=True)
        di.topk_indices(x.bfloat16(), k, ks, ke, index_mode="absolute")
        # slot entries through a table of 64-column blocks (a short one: columns past it give -1)
        bt = torch.randperm(m * 700, generator=gen).to(torch.int32).view(m, 700)[:, :500].cuda()
        di.topk_indices(x, k, context_lens=ke, index_mode="slot", block_table=bt, block_size=64)
    finally:
        _restore(old)


@case
def topk_buffered():
    _topk(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=1, DI_TOPK_WIDE=0)
    _topk(k=100, DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=1, DI_TOPK_WIDE=0)
    _topk(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=1, DI_TOPK_WIDE=0, DI_TOPK_PACKED=0)  # bfloat16 survivors in two words
    # aligned rows of 65536 columns from misaligned starts: survivors in one word, the last at position 65535
    import deep_indexer as di

    old = _env(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=1, DI_TOPK_WIDE=0)
    try:
        x = torch.randn(3, 65536, generator=torch.Generator().manual_seed(5)).cuda().bfloat16()
        x[:, -4:] = 100.0
        ks = torch.tensor([7, 1, 0], dtype=torch.int32, device="cuda")
        di.topk_indices(x, 2048, ks, torch.full_like(ks, 65536), index_mode="absolute", return_values=True)
    finally:
        _restore(old)


@case
def topk_buffered_many_rows():
    # more rows than CTAs (clusters): each takes rows in turn, with the survivor counters alternating and
    # the sample searching from the previous row's threshold (rows of changing scale)
    import deep_indexer as di

    gen = torch.Generator().manual_seed(2)
    m, n = 700, 9000
    x = (torch.randn(m, n, generator=gen) * 2.0 ** torch.randint(-12, 13, (m, 1), generator=gen).float()).cuda()
    ke = torch.randint(n - 3000, n + 1, (m,), generator=gen, dtype=torch.int32).cuda()
    for cluster in (1, 2):
        old = _env(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=cluster, DI_TOPK_WIDE=0)
        try:
            di.topk_indices(x.bfloat16(), 512, None, ke)
            di.topk_indices(x, 2048, None, ke)
        finally:
            _restore(old)


@case
def topk_sorted():
    import deep_indexer as di

    x = torch.randn(3, 5000, device="cuda")
    ke = torch.tensor([5000, 10, 4000], dtype=torch.int32, device="cuda")
    di.topk_indices(x, 512, None, ke, sorted=True)
    di.topk_indices(x.bfloat16(), 512, None, ke, sorted=True)


@case
def topk_cluster():
    _topk(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=2, DI_TOPK_WIDE=0)


@case
def topk_wide():
    _topk(DI_TOPK_RESIDENT=0, DI_TOPK_CLUSTER=1, DI_TOPK_WIDE=1)


@case
def topk_resident():
    _topk(DI_TOPK_RESIDENT=1, DI_TOPK_RESIDENT_THREADS=1024, DI_TOPK_RESIDENT_KEYS=8)  # rows over clusters
    _topk(DI_TOPK_RESIDENT=1, DI_TOPK_RESIDENT_THREADS=256, DI_TOPK_RESIDENT_KEYS=16)


def _resident_per_sm(per_sm: int, seed: int, n: int, calls):
    """Five rows of up to n float32 keys (misaligned, an empty and a short range) through `calls(x, ks, ke, n)`
    with DI_TOPK_RESIDENT_CTAS_PER_SM=per_sm."""
    old = _env(DI_TOPK_RESIDENT_CTAS_PER_SM=per_sm)
    try:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(5, n + 4, generator=gen)[:, 1:n + 1].cuda()
        ks = torch.tensor([0, 3, 100, 7, 0], dtype=torch.int32, device="cuda")
        ke = torch.tensor([n, n - 1, 300, 7, n // 2], dtype=torch.int32, device="cuda")
        calls(x, ks, ke, gen)
    finally:
        _restore(old)


@case
def topk_resident_two_per_sm():
    import deep_indexer as di

    def calls(x, ks, ke, gen):
        di.topk_indices(x.bfloat16(), 512, ks, ke, index_mode="absolute", return_values=True)  # 24 keys a thread
        di.topk_indices(x[:, :6000].contiguous(), 512, ks, ke.clamp(max=6000))  # float32, 12 keys a thread
        di.topk_indices(x.bfloat16(), 2048, ks, ke)  # entries staged in shared memory (4 or more a thread)
        ties = torch.randint(0, 64, tuple(x.shape), generator=gen).float().cuda()  # float32, 24 keys, every pass
        di.topk_indices(ties, 2048, ks, ke, return_values=True)
        # slot entries staged: mapped through the block table (a short one: columns past it give -1)
        bt = torch.randperm(5 * 200, generator=gen).to(torch.int32).view(5, 200)[:, :150].cuda()
        di.topk_indices(x, 2048, context_lens=ke, index_mode="slot", block_table=bt, block_size=64)
        bt4 = torch.randperm(5 * 3000, generator=gen).to(torch.int32).view(5, 3000).cuda()  # a thread's columns span blocks
        di.topk_indices(x, 1024, context_lens=ke, index_mode="slot", block_table=bt4, block_size=4)

    _resident_per_sm(2, 2, 12000, calls)


@case
def topk_resident_four_per_sm():
    import deep_indexer as di

    def calls(x, ks, ke, gen):
        di.topk_indices(x.bfloat16(), 512, ks, ke, index_mode="absolute", return_values=True)  # 32 keys a thread
        di.topk_indices(x[:, :5000].contiguous(), 2048, ks, ke.clamp(max=5000))  # float32, 20 keys a thread
        # aligned rows of exactly one CTA's keys from misaligned starts to the last column
        di.topk_indices(x.bfloat16().contiguous(), 512, ks % 8 + 1, torch.full_like(ke, x.shape[1]))

    _resident_per_sm(4, 4, 8192, calls)


@case
def topk_resident_packed():
    # the one-CTA bfloat16 forms (keys two per register): 1024 threads x 16 and x 32 keys, misaligned rows
    import deep_indexer as di

    gen = torch.Generator().manual_seed(3)
    for keys, n in ((16, 16000), (32, 32760)):
        old = _env(DI_TOPK_RESIDENT=1, DI_TOPK_RESIDENT_THREADS=1024, DI_TOPK_RESIDENT_KEYS=keys)
        try:
            x = torch.randn(5, n + 8, generator=gen)[:, 1:n + 1].cuda().bfloat16()
            ks = torch.tensor([0, 3, 100, 7, 0], dtype=torch.int32, device="cuda")
            ke = torch.tensor([n, n - 1, 300, 7, n // 2], dtype=torch.int32, device="cuda")
            di.topk_indices(x, 2048, ks, ke, index_mode="absolute", return_values=True)
            di.topk_indices(x[:, :n - 8].contiguous(), 512, None, ke.clamp(max=n - 8))
        finally:
            _restore(old)


@case
def fused_mqa_topk():
    import deep_indexer as di
    from deep_indexer.bench import prefill_inputs

    x = prefill_inputs(96, 2048, "causal", 64, 128, "cuda")
    di.fp8_mqa_topk_indices(x["q"], x["kv"], x["weights"], x["ks"], x["ke"], 64, chunk_rows=40)


@case
def fused_paged_topk():
    import deep_indexer as di

    x, ctx, meta = _decode(2)
    di.fp8_paged_mqa_topk_indices(x["q"], x["kv_cache"], x["weights"], ctx, x["block_table"], meta,
                                  x["max_context_len"], 64)


# ------------------------------------------------------------------------------------------------ training


def _training_inputs(t, di_, heads=128, kv_heads=0, dqk=576, seed=0, heads_i=64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device="cuda", dtype=torch.bfloat16)

    q_i, k_i = r(t, heads_i, di_, std=di_ ** -0.25), r(t, di_, std=di_ ** -0.25)
    w = (torch.randn(t, heads_i, generator=g) * 0.25).cuda()
    q = r(t, heads, dqk)
    k = r(t, dqk) if kv_heads == 0 else r(t, kv_heads, dqk)
    return [x.requires_grad_() for x in (q_i, k_i, w)] + [q, k]


# two packed sequences (one empty) and a row range that is not a multiple of any tile
_CU = [0, 70, 70, 200]


@case
def training_logits():
    """indexer_logits forward (training_logits) and backward (training_indexer_dk with the sign mask, the masked dq)."""
    from deep_indexer.training import indexer_logits

    cu = torch.tensor(_CU, dtype=torch.int32)
    for d in (64, 128):
        q_i, k_i, w, _, _ = _training_inputs(200, d, seed=d)
        out = indexer_logits(q_i, k_i, w, cu_seqlens=cu, backend="sm90")
        torch.where(torch.isfinite(out), out, torch.zeros_like(out)).sum().backward()


@case
def training_mean_loss():
    """indexer_kl_loss target="mean": the attention lse and target kernels (clusters 1, 2), the dk kernel with the
    loss (kLoss) and the dq kernel."""
    from deep_indexer.training import indexer_kl_loss

    cu = torch.tensor(_CU, dtype=torch.int32)
    q_i, k_i, w, q, k = _training_inputs(200, 128, dqk=128, seed=3)
    for cluster in (1, 2):
        old = _env(DI_TRAINING_TARGET_CLUSTER=cluster)
        try:
            res = indexer_kl_loss(q_i, k_i, w, q, k, 0.05, cu_seqlens=cu, backend="sm90")
            res.loss.backward()
        finally:
            _restore(old)


@case
def training_per_head_loss():
    """indexer_kl_loss target="per_head": training_per_head_rows and training_per_head_dk (1 and 2 head groups)."""
    from deep_indexer.training import indexer_kl_loss

    cu = torch.tensor(_CU, dtype=torch.int32)
    q_i, k_i, w, q, k = _training_inputs(200, 64, heads=8, kv_heads=8, dqk=128, seed=5, heads_i=8)
    lse = torch.zeros(200, 8, device="cuda")
    for groups in (1, 2):
        old = _env(DI_TRAINING_PER_HEAD_GROUPS=groups)
        try:
            res = indexer_kl_loss(q_i, k_i, w, q, k, 0.1, cu_seqlens=cu, attn_lse=lse, target="per_head",
                                  backend="sm90")
            res.loss.backward()
        finally:
            _restore(old)


# ------------------------------------------------------------------------------------------------ driver / parser


def precompile(jobs: int) -> int:
    """Compiles the kernel variants the cases use (a superset), `jobs` at a time, so that no case compiles under
    the sanitizer and the plain run does not compile them one by one."""
    from concurrent.futures import ThreadPoolExecutor

    from deep_indexer import _C, jit

    groups = [dict(ops=["topk", "clean_logits", "paged_mqa_logits_metadata", "fp4_fold", "fp4_prefill_fold"]),
              dict(ops=["mqa_logits"], heads=[64], head_dims=[128]),
              dict(ops=["paged_mqa_logits"], heads=[64], head_dims=[128], next_n=[1, 2, 4], block_kv=[32, 64]),
              dict(ops=["training_logits", "training_logits_stats"], heads=[64], head_dims=[64, 128]),
              dict(ops=["training_target"], head_dims=[128]),
              dict(ops=["training_indexer_dk", "training_indexer_dq"], head_dims=[64, 128]),
              dict(ops=["training_per_head_rows", "training_per_head_dk"], head_dims=[64])]
    todo = []
    for g in groups:
        for v in jit.variants(**g):
            p = dict(v.params)
            if v.op == "topk" and p.get("resident") and (p["threads"], p["keys_per_thread"]) not in ((1024, 8), (256, 16)):
                continue  # the resident forms the cases force
            if v.op.startswith("training_per_head") and p["qk_dim"] != 128:
                continue
            todo.append(v)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        res = list(pool.map(lambda v: _C.precompile_variant(v.op, dict(v.params), "sm_90a"), todo))
    errors = [r for r in res if r.get("error")]
    print(f"precompiled {len(res)} variants ({sum(bool(r.get('from_cache')) for r in res)} cached), "
          f"{len(errors)} errors")
    for r in errors:
        print(f"  {r.get('kernel')} {r.get('params')}: {r['error'][:300]}")
    return 1 if errors else 0


def run(names) -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("sanitize_cases: needs an SM90 GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for name in names:
        print(f"@@case {name}", flush=True)
        CASES[name]()
        torch.cuda.synchronize()
        print(f"@@done {name}", flush=True)
    return 0


_HEAD = re.compile(r"^========= (?!\s)(.*)$")
_NOT_REPORT = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application|"
                         r"This application|Program hit|No .* detected)")


def parse(log_path: str, tool: str) -> int:
    """Splits the log into the cases' sections and its reports (a `========= X` line and its indented lines)."""
    sections: dict[str, list[str]] = {}
    done: set[str] = set()
    cur = "(startup)"
    report: list[str] | None = None

    def close():
        nonlocal report
        if report:
            sections.setdefault(cur, []).append("\n".join(report))
        report = None

    with open(log_path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("@@case "):
                close()
                cur = line.split()[1]
                sections.setdefault(cur, [])
                continue
            if line.startswith("@@done "):
                close()
                done.add(line.split()[1])
                continue
            m = _HEAD.match(line)
            if m:
                close()
                if not _NOT_REPORT.match(m.group(1)) and m.group(1).strip():
                    report = [line]
            elif report is not None and line.startswith("=========  "):
                report.append(line)
            else:
                close()
    close()
    bad = 0
    for name, reports in sections.items():
        if name == "(startup)" and not reports:
            continue
        kept, suppressed = [], 0
        for r in reports:
            if any(t == tool and re.search(p, r, re.S) for t, p, _ in SUPPRESSIONS):
                suppressed += 1
            else:
                kept.append(r)
        status = "clean" if not kept else f"{len(kept)} reports"
        if name != "(startup)" and name not in done:
            status += " (did not finish)"
            bad += 1
        extra = f", {suppressed} suppressed" if suppressed else ""
        print(f"{tool:10s} {name:26s} {status}{extra}")
        for r in kept[:3]:
            print("    " + r.replace("\n", "\n    ")[:1200])
        bad += len(kept)
    missing = [n for n in CASES if n not in sections]
    if missing:
        print(f"{tool:10s} not run: {' '.join(missing)}")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=sorted(CASES), help="cases to run (default: all)")
    p.add_argument("--list", action="store_true", help="print the case names")
    p.add_argument("--precompile", type=int, metavar="JOBS", help="compile the cases' kernel variants, JOBS at a time")
    p.add_argument("--parse", metavar="LOG", help="summarise a compute-sanitizer log of a run")
    p.add_argument("--tool", default="memcheck", help="the tool that wrote LOG (for SUPPRESSIONS)")
    a = p.parse_args()
    if a.list:
        print("\n".join(CASES))
        return 0
    if a.parse:
        return parse(a.parse, a.tool)
    if a.precompile:
        return precompile(a.precompile)
    return run(a.only or list(CASES))


if __name__ == "__main__":
    sys.exit(main())

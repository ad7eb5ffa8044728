"""The lightning indexer as an inference engine runs it, with the time of each stage.

Decode step: write the new tokens' keys into the paged fp8 cache, build the schedule, compute the
logits over every sequence's context, take the top-2048 keys per query row. Prefill chunk: score a
chunk of query tokens against the (fp8, per-token scaled) keys of the prompt so far, causally, and
take the top-2048. Needs an SM90 GPU.

    python examples/indexer_step.py [--batch 64] [--context 32768] [--next-n 2] [--chunk 4096]
"""
import argparse

import torch

import deep_indexer as di
from deep_indexer import quant

TOPK = 2048


def timed(label: str, fn, results: dict, iters: int = 20):
    out = fn()  # warm-up (kernel load)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        out = fn()
    end.record()
    end.synchronize()
    results[label] = start.elapsed_time(end) / iters * 1e3
    return out


def decode_step(batch: int, context: int, next_n: int, heads: int, dim: int, block_kv: int) -> dict:
    dev = torch.device("cuda")
    times: dict = {}
    lens = torch.randint(context // 2, context, (batch,), dtype=torch.int32)
    keys = [torch.randn(int(n) - next_n, dim, device=dev, dtype=torch.bfloat16) for n in lens]
    max_blocks = (int(lens.max()) + block_kv - 1) // block_kv
    cache, table, ctx = quant.pack_paged_kv_cache(keys, block_kv, num_blocks=batch * max_blocks + batch)
    # The step's new tokens (next_n per sequence) land in the slots after each prefix.
    pos = ctx[:, None] + torch.arange(next_n, device=dev)
    blocks_needed = (int(pos.max()) + block_kv) // block_kv
    if table.shape[1] < blocks_needed:  # room in the block table for the new tokens
        table = torch.cat([table, torch.zeros(batch, blocks_needed - table.shape[1], dtype=torch.int32, device=dev)], 1)
    free = torch.arange(cache.shape[0] - batch, cache.shape[0], dtype=torch.int32, device=dev)
    last = (pos[:, -1] // block_kv).long()
    need_new = (pos[:, -1] // block_kv) != ((ctx - 1).clamp(min=0) // block_kv)
    table[torch.arange(batch, device=dev)[need_new], last[need_new]] = free[need_new]
    slots = (table.gather(1, (pos // block_kv).long()).long() * block_kv + pos % block_kv).reshape(-1)
    new_k = torch.randn(batch * next_n, dim, device=dev, dtype=torch.bfloat16)
    ctx = (ctx + next_n).to(torch.int32)

    q = torch.randn(batch, next_n, heads, dim, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    w = torch.randn(batch * next_n, heads, device=dev)
    timed("decode: write K into the paged cache", lambda: quant.write_paged_kv_cache(cache, new_k, slots), times)
    meta = timed("decode: schedule metadata", lambda: di.get_paged_mqa_logits_metadata(ctx, block_kv), times)
    max_ctx = int(ctx.max())
    logits = timed("decode: paged logits",
                   lambda: di.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, False), times)
    # The attention reads cache slots: top-2048 per query row, mapped through the block table.
    timed("decode: top-2048 cache slots (deep_indexer)",
          lambda: di.topk_indices(logits, TOPK, context_lens=ctx, next_n=next_n, index_mode="slot",
                                  block_table=table, block_size=block_kv), times)
    ws = di.topk_workspace(batch * next_n, max_ctx, device=dev)
    timed("decode: metadata + logits + top-2048 in one call",
          lambda: di.fp8_paged_mqa_topk_indices(q, cache, w, ctx, table, di.get_paged_mqa_logits_metadata(ctx, block_kv),
                                                max_ctx, TOPK, index_mode="slot", workspace=ws), times)
    di.clean_logits(logits, None, ctx, next_n)  # torch.topk needs -inf past each row's context
    timed("decode: top-2048 (torch.topk, for comparison)", lambda: logits.topk(min(TOPK, max_ctx), dim=-1), times)
    return times


def prefill_chunk(chunk: int, prefix: int, heads: int, dim: int) -> dict:
    dev = torch.device("cuda")
    times: dict = {}
    skv = prefix + chunk
    k_bf16 = torch.randn(skv, dim, device=dev, dtype=torch.bfloat16)
    k, k_scale = timed("prefill: quantize K (per token fp8)", lambda: quant.per_token_cast_to_fp8(k_bf16), times)
    q = torch.randn(chunk, heads, dim, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    w = torch.randn(chunk, heads, device=dev)
    ks = torch.zeros(chunk, dtype=torch.int32, device=dev)
    ke = (prefix + torch.arange(chunk, device=dev) + 1).to(torch.int32)  # causal: token i sees prefix + i + 1 keys
    logits = timed("prefill: logits", lambda: di.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, True), times)
    timed("prefill: top-2048 (deep_indexer)", lambda: di.topk_indices(logits, TOPK, ks, ke), times)
    timed("prefill: top-2048 (torch.topk, for comparison)", lambda: logits.topk(TOPK, dim=-1), times)
    timed("prefill: logits + top-2048 without the [S, SKV] buffer",
          lambda: di.fp8_mqa_topk_indices(q, (k, k_scale), w, ks, ke, TOPK), times)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--next-n", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block-kv", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=28672)
    a = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("this example needs an SM90 (Hopper) GPU")
    times = decode_step(a.batch, a.context, a.next_n, a.heads, a.dim, a.block_kv)
    times.update(prefill_chunk(a.chunk, a.prefix, a.heads, a.dim))
    print(f"decode: B={a.batch} context~{a.context} next_n={a.next_n}; prefill: chunk={a.chunk} prefix={a.prefix}; "
          f"H={a.heads} D={a.dim}")
    for k, v in times.items():
        print(f"  {k:<40} {v:10.1f} us")


if __name__ == "__main__":
    main()

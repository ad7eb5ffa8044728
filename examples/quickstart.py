"""Quickstart: build indexer inputs with deep_indexer.quant, call every op, check against the reference.

    python examples/quickstart.py        (needs an SM90 GPU: H100 / H200 / H800 / H20)
"""
import torch

import deep_indexer as di
from deep_indexer import quant, reference

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    raise SystemExit("this example needs an SM90 (Hopper) GPU")

torch.manual_seed(0)
dev = "cuda"
H, D = 64, 128  # indexer heads and head dim of DeepSeek-V3.2


def close(got, ref):
    """Relative difference 1 - 2<x,y>/(|x|^2+|y|^2) over the valid (finite) entries."""
    valid = torch.isfinite(ref)
    x, y = got[valid].double(), ref[valid].double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp(min=1e-30))


# ---- prefill: S query tokens over SKV keys, causal (row i sees keys 0 .. SKV - S + i)
S, SKV = 512, 2048
q = torch.randn(S, H, D, device=dev).to(torch.float8_e4m3fn)
k, k_scale = quant.per_token_cast_to_fp8(torch.randn(SKV, D, device=dev))  # fp8 keys + one fp32 scale per key
weights = torch.randn(S, H, device=dev)  # per-(token, head) weights (fold q's scale in here)
ks = torch.zeros(S, dtype=torch.int32, device=dev)
ke = torch.arange(SKV - S + 1, SKV + 1, dtype=torch.int32, device=dev)  # exclusive end of each row's keys

logits = di.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, clean_logits=True)  # [S, SKV], -inf outside
ref = reference.mqa_logits(q, (k, k_scale), weights, ks, ke)
print(f"prefill logits {tuple(logits.shape)}: relative difference to the reference {close(logits, ref):.1e}")

# the keys the sparse attention then reads: exact top-k of each row's range, ties to the smaller column
top = di.topk_indices(logits, 256, ks, ke)  # [S, 256] int32 (-1 past a row's valid keys)
assert torch.equal(top.cpu(), reference.topk_indices(logits.cpu(), 256, ks.cpu(), ke.cpu()))
print(f"top-k indices {tuple(top.shape)}: the reference's exactly")

# clean_logits=False leaves entries outside each row's range unspecified; clean_logits() fills them later.
raw = di.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, clean_logits=False)
di.clean_logits(raw, ks, ke)
assert torch.equal(torch.isinf(raw), torch.isinf(ref))

# ---- decode: B sequences in a paged fp8 cache, next_n query tokens each (1 + speculative tokens)
B, next_n, block_kv = 8, 2, 64
lens = torch.randint(100, 5000, (B,))
keys = [torch.randn(int(n), D, device=dev) for n in lens]  # each sequence's keys (bf16/fp32)
kv_cache, block_table, context_lens = quant.pack_paged_kv_cache(keys, block_kv)  # uint8 [blocks, 64, 1, D + 4]
q_dec = torch.randn(B, next_n, H, D, device=dev).to(torch.float8_e4m3fn)
w_dec = torch.randn(B * next_n, H, device=dev)
max_context_len = int(lens.max())

schedule = di.get_paged_mqa_logits_metadata(context_lens, block_kv)  # work split over the SMs, on the GPU
dec = di.fp8_paged_mqa_logits(q_dec, kv_cache, w_dec, context_lens, block_table, schedule, max_context_len,
                              clean_logits=True)  # [B * next_n, max_context_len]
ref = reference.paged_mqa_logits(q_dec, kv_cache, w_dec, context_lens, block_table, max_context_len)
print(f"decode logits {tuple(dec.shape)}: relative difference to the reference {close(dec, ref):.1e}")

# ---- the same decode step through DeepGEMM's names, as vLLM and SGLang call it: q as (q, None),
# 2-D context lengths [B, next_n] (row i of a sequence's window sees keys j < ctx[b, i]), num_sms given.
from deep_indexer import deep_gemm  # noqa: E402

ctx_2d = (context_lens[:, None] - next_n + 1 + torch.arange(next_n, device=dev)).to(torch.int32)
schedule = deep_gemm.get_paged_mqa_logits_metadata(ctx_2d, block_kv, deep_gemm.get_num_sms())
dec2 = deep_gemm.fp8_fp4_paged_mqa_logits((q_dec, None), kv_cache, w_dec, ctx_2d, block_table, schedule,
                                          max_context_len, clean_logits=True)
assert close(dec2, dec) < 1e-6 and torch.equal(torch.isinf(dec2), torch.isinf(dec))
print("DeepGEMM-named call: the same logits")

"""torch.ops.deep_indexer.*: every public op as a PyTorch custom op with a schema, a CUDA
implementation and a fake (meta) implementation whose outputs have the real shapes, dtypes and
padded strides, so the ops trace under torch.compile(fullgraph=True) and CUDA graphs.

Functional ops return fresh logits; the `*_out` ops and `clean_logits` mutate their `out` /
`logits` argument (declared in the schema) and return nothing. The schemas come from
deep_indexer._signatures.TORCH_OPS; each op's real and fake implementations below get every argument
positionally in that order.
"""
from __future__ import annotations

import torch
from torch import Tensor

import deep_indexer._C as _C
from ._signatures import TORCH_OPS, op

_LIB = "deep_indexer"
_ELEM = {torch.float32: 4, torch.bfloat16: 2}


def padded_row_stride(cols: int, dtype: torch.dtype) -> int:
    """Row stride of logits the ops allocate: rows start 256-byte aligned (csrc/impls/heuristics_sm90.hpp)."""
    align = 256 // _ELEM[dtype]
    return (cols + align - 1) // align * align


def elem_bytes(dtype: torch.dtype, op: str = "deep_indexer") -> int:
    """Bytes per logit of a supported logits dtype; ValueError naming `op` otherwise."""
    if dtype not in _ELEM:
        raise ValueError(f"{op}: logits_dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    return _ELEM[dtype]


_elem = elem_bytes


def paged_cache_rows_error(op: str, q, q_sf, kv_cache):
    """The ValueError for a decode kv_cache whose rows fit neither cache layout for q's head dim (D + 4 bytes:
    FP8, D / 2 + 4: FP4; D = q.size(-1), or twice that for FP4 codes with q_sf), else None (also when D itself
    is not supported: the op's own error says so)."""
    if not isinstance(kv_cache, Tensor) or not isinstance(q, Tensor) or kv_cache.dim() != 4 or q.dim() != 4:
        return None
    d = q.shape[-1] * (2 if q_sf is not None else 1)
    if d not in (64, 128) or kv_cache.shape[-1] in (d + 4, d // 2 + 4):
        return None
    return ValueError(f"deep_indexer.{op}: kv_cache rows must hold D + 4 = {d + 4} bytes (the FP8 cache) or "
                      f"D / 2 + 4 = {d // 2 + 4} bytes (the FP4 cache) for D = {d} (from q"
                      f"{'_fp4' if q_sf is not None else ''}), got {kv_cache.shape[-1]} "
                      f"(kv_cache shape {list(kv_cache.shape)})")


def _fake_logits(like: Tensor, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    return like.new_empty_strided((rows, cols), (padded_row_stride(cols, dtype), 1), dtype=dtype)


def _custom_op(name: str, real, fake, mutates_args=()):
    """torch.ops.deep_indexer.<name> with TORCH_OPS[name]'s schema, `real` on CUDA and `fake` for tracing."""
    view = TORCH_OPS[name]
    fn = torch.library.custom_op(f"{_LIB}::{name}", op(view, checks=False, name=name)(real),
                                 mutates_args=mutates_args, device_types="cuda")
    fn.register_fake(op(view, checks=False, name=name)(fake))
    return fn


# ------------------------------------------------------------------------------------ prefill
def _mqa_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, logits_dtype, max_seqlen_k):
    return _C.fp8_mqa_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                             elem_bytes(logits_dtype), None, max_seqlen_k)


def _mqa_logits_fake(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, logits_dtype,
                     max_seqlen_k):
    elem_bytes(logits_dtype)
    if max_seqlen_k < 0:
        raise ValueError(f"deep_indexer.fp8_mqa_logits: max_seqlen_k must be >= 0, got {max_seqlen_k}")
    return _fake_logits(q, q.shape[0], max_seqlen_k if max_seqlen_k > 0 else k.shape[0], logits_dtype)


def _mqa_logits_out(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out, max_seqlen_k):
    _C.fp8_mqa_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, elem_bytes(out.dtype),
                      out, max_seqlen_k)


def _mqa_logits_out_fake(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out,
                         max_seqlen_k):
    return None


fp8_mqa_logits = _custom_op("fp8_mqa_logits", _mqa_logits, _mqa_logits_fake)
fp8_mqa_logits_out = _custom_op("fp8_mqa_logits_out", _mqa_logits_out, _mqa_logits_out_fake, ("out",))


# ------------------------------------------------------------------------------------ decode
def _metadata(context_lens, block_kv, num_sms, indices):
    return _C.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, None, indices)


def _metadata_fake(context_lens, block_kv, num_sms, indices):
    # the SM count the real op uses: set_num_sms's cap when set, else the device's
    sms = num_sms if num_sms is not None else _C.get_num_sms(
        torch.cuda.current_device() if context_lens.device.index is None else context_lens.device.index)
    return context_lens.new_empty((sms + 1, 2), dtype=torch.int32)


def _metadata_out(context_lens, block_kv, out, indices):
    _C.get_paged_mqa_logits_metadata(context_lens, block_kv, out.shape[0] - 1, out, indices)


def _metadata_out_fake(context_lens, block_kv, out, indices):
    return None


# q: fp8 [B, next_n, H, D] with q_sf None, or FP4 codes uint8 [B, next_n, H, D / 2] with q_sf int32 [B, next_n, H];
# the kernel tells the cache layouts apart by their row bytes.
def _paged_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                  logits_dtype, indices, q_sf):
    return _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                   clean_logits, elem_bytes(logits_dtype), None, indices, q_sf)


def _paged_check_fake(q, kv_cache, q_sf):
    err = paged_cache_rows_error("fp8_paged_mqa_logits", q, q_sf, kv_cache)
    if err is not None:
        raise err


def _paged_logits_fake(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                       logits_dtype, indices, q_sf):
    elem_bytes(logits_dtype)
    _paged_check_fake(q, kv_cache, q_sf)
    return _fake_logits(q, q.shape[0] * q.shape[1], max_context_len, logits_dtype)


def _paged_logits_out(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                      out, indices, q_sf):
    _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                            clean_logits, elem_bytes(out.dtype), out, indices, q_sf)


def _paged_logits_out_fake(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                           clean_logits, out, indices, q_sf):
    _paged_check_fake(q, kv_cache, q_sf)
    return None


get_paged_mqa_logits_metadata = _custom_op("get_paged_mqa_logits_metadata", _metadata, _metadata_fake)
get_paged_mqa_logits_metadata_out = _custom_op("get_paged_mqa_logits_metadata_out", _metadata_out,
                                               _metadata_out_fake, ("out",))
fp8_paged_mqa_logits = _custom_op("fp8_paged_mqa_logits", _paged_logits, _paged_logits_fake)
fp8_paged_mqa_logits_out = _custom_op("fp8_paged_mqa_logits_out", _paged_logits_out, _paged_logits_out_fake, ("out",))


# ------------------------------------------------------------------------------------ clean
def _clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n):
    _C.clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)


def _clean_logits_fake(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n):
    return None


clean_logits = _custom_op("clean_logits", _clean_logits, _clean_logits_fake, ("logits",))


# ------------------------------------------------------------------------------------ top-k
def _topk_out(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
              block_size, row_offset, out, out_values, indices):
    _C.topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode,
                    block_table, block_size, row_offset, out_values is not None, out, out_values, indices)


def _topk_out_fake(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode,
                   block_table, block_size, row_offset, out, out_values, indices):
    return None


def _topk(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
          block_size, row_offset, indices):
    return _C.topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode,
                           block_table, block_size, row_offset, False, None, None, indices)[0]


def _topk_fake(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
               block_size, row_offset, indices):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


topk_indices_out = _custom_op("topk_indices_out", _topk_out, _topk_out_fake, ("out", "out_values"))
topk_indices = _custom_op("topk_indices", _topk, _topk_fake)

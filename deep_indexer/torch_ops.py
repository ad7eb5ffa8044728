"""torch.ops.deep_indexer.*: every public op as a PyTorch custom op with a schema, a CUDA
implementation and a fake (meta) implementation whose outputs have the real shapes, dtypes and
padded strides, so the ops trace under torch.compile(fullgraph=True) and CUDA graphs.

Functional ops return fresh logits; the `*_out` ops and `clean_logits` mutate their `out` /
`logits` argument (declared in the schema) and return nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C

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

def _fake_logits(like: Tensor, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    return like.new_empty_strided((rows, cols), (padded_row_stride(cols, dtype), 1), dtype=dtype)

# ------------------------------------------------------------------------------------ prefill
@torch.library.custom_op(f"{_LIB}::fp8_mqa_logits", mutates_args=(), device_types="cuda")
def fp8_mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, cu_seq_len_k_start: Tensor,
                   cu_seq_len_k_end: Tensor, clean_logits: bool = True,
                   logits_dtype: torch.dtype = torch.float32, max_seqlen_k: int = 0) -> Tensor:
    return _C.fp8_mqa_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                             elem_bytes(logits_dtype), None, max_seqlen_k)

@fp8_mqa_logits.register_fake
def _(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, logits_dtype=torch.float32,
      max_seqlen_k=0):
    elem_bytes(logits_dtype)
    if max_seqlen_k < 0:
        raise ValueError(f"deep_indexer.fp8_mqa_logits: max_seqlen_k must be >= 0, got {max_seqlen_k}")
    return _fake_logits(q, q.shape[0], max_seqlen_k if max_seqlen_k > 0 else k.shape[0], logits_dtype)

@torch.library.custom_op(f"{_LIB}::fp8_mqa_logits_out", mutates_args=("out",), device_types="cuda")
def fp8_mqa_logits_out(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, cu_seq_len_k_start: Tensor,
                       cu_seq_len_k_end: Tensor, clean_logits: bool, out: Tensor, max_seqlen_k: int = 0) -> None:
    _C.fp8_mqa_logits(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, elem_bytes(out.dtype),
                      out, max_seqlen_k)

@fp8_mqa_logits_out.register_fake
def _(q, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, out, max_seqlen_k=0):
    return None

# ------------------------------------------------------------------------------------ decode
@torch.library.custom_op(f"{_LIB}::get_paged_mqa_logits_metadata", mutates_args=(), device_types="cuda")
def get_paged_mqa_logits_metadata(context_lens: Tensor, block_kv: int, num_sms: Optional[int] = None,
                                  indices: Optional[Tensor] = None) -> Tensor:
    return _C.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, None, indices)

@get_paged_mqa_logits_metadata.register_fake
def _(context_lens, block_kv, num_sms=None, indices=None):
    # the SM count the real op uses: set_num_sms's cap when set, else the device's
    sms = num_sms if num_sms is not None else _C.get_num_sms(
        torch.cuda.current_device() if context_lens.device.index is None else context_lens.device.index)
    return context_lens.new_empty((sms + 1, 2), dtype=torch.int32)

@torch.library.custom_op(f"{_LIB}::get_paged_mqa_logits_metadata_out", mutates_args=("out",), device_types="cuda")
def get_paged_mqa_logits_metadata_out(context_lens: Tensor, block_kv: int, out: Tensor,
                                      indices: Optional[Tensor] = None) -> None:
    _C.get_paged_mqa_logits_metadata(context_lens, block_kv, out.shape[0] - 1, out, indices)

@get_paged_mqa_logits_metadata_out.register_fake
def _(context_lens, block_kv, out, indices=None):
    return None

@torch.library.custom_op(f"{_LIB}::fp8_paged_mqa_logits", mutates_args=(), device_types="cuda")
def fp8_paged_mqa_logits(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                         schedule_meta: Tensor, max_context_len: int, clean_logits: bool = False,
                         logits_dtype: torch.dtype = torch.float32, indices: Optional[Tensor] = None) -> Tensor:
    return _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                   clean_logits, elem_bytes(logits_dtype), None, indices)

@fp8_paged_mqa_logits.register_fake
def _(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits=False,
      logits_dtype=torch.float32, indices=None):
    elem_bytes(logits_dtype)
    return _fake_logits(q, q.shape[0] * q.shape[1], max_context_len, logits_dtype)

@torch.library.custom_op(f"{_LIB}::fp8_paged_mqa_logits_out", mutates_args=("out",), device_types="cuda")
def fp8_paged_mqa_logits_out(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                             schedule_meta: Tensor, max_context_len: int, clean_logits: bool, out: Tensor,
                             indices: Optional[Tensor] = None) -> None:
    _C.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                            clean_logits, elem_bytes(out.dtype), out, indices)

@fp8_paged_mqa_logits_out.register_fake
def _(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits, out,
      indices=None):
    return None

# ------------------------------------------------------------------------------------ clean
@torch.library.custom_op(f"{_LIB}::clean_logits", mutates_args=("logits",), device_types="cuda")
def clean_logits(logits: Tensor, cu_seq_len_k_start: Optional[Tensor], cu_seq_len_k_end: Tensor,
                 next_n: int = 1) -> None:
    _C.clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)

@clean_logits.register_fake
def _(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n=1):
    return None

# ------------------------------------------------------------------------------------ top-k
@torch.library.custom_op(f"{_LIB}::topk_indices_out", mutates_args=("out", "out_values"), device_types="cuda")
def topk_indices_out(logits: Tensor, k: int, cu_seq_len_k_start: Optional[Tensor], cu_seq_len_k_end: Optional[Tensor],
                     context_lens: Optional[Tensor], next_n: int, sorted: bool, index_mode: str,
                     block_table: Optional[Tensor], block_size: int, row_offset: Optional[Tensor], out: Tensor,
                     out_values: Optional[Tensor], indices: Optional[Tensor] = None) -> None:
    _C.topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode,
                    block_table, block_size, row_offset, out_values is not None, out, out_values, indices)

@topk_indices_out.register_fake
def _(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode, block_table,
      block_size, row_offset, out, out_values, indices=None):
    return None

@torch.library.custom_op(f"{_LIB}::topk_indices", mutates_args=(), device_types="cuda")
def topk_indices(logits: Tensor, k: int, cu_seq_len_k_start: Optional[Tensor] = None,
                 cu_seq_len_k_end: Optional[Tensor] = None, context_lens: Optional[Tensor] = None, next_n: int = 1,
                 sorted: bool = False, index_mode: str = "relative", block_table: Optional[Tensor] = None,
                 block_size: int = 0, row_offset: Optional[Tensor] = None, indices: Optional[Tensor] = None) -> Tensor:
    return _C.topk_indices(logits, k, cu_seq_len_k_start, cu_seq_len_k_end, context_lens, next_n, sorted, index_mode,
                           block_table, block_size, row_offset, False, None, None, indices)[0]

@topk_indices.register_fake
def _(logits, k, cu_seq_len_k_start=None, cu_seq_len_k_end=None, context_lens=None, next_n=1, sorted=False,
      index_mode="relative", block_table=None, block_size=0, row_offset=None, indices=None):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)

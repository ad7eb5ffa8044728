"""The public API of deep_indexer implemented in plain PyTorch (on `deep_indexer.reference`).

A stand-in with the same signatures (deep_indexer._signatures) for `python -m deep_indexer bench
--compare deep_indexer.baseline`: it shows `--compare` at work and what an engine without custom
kernels pays (it syncs with the host and allocates per call). `out=` and `logits_dtype` behave as in
deep_indexer; -inf is always written outside the valid ranges (clean_logits only selects nothing
extra here).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from ._signatures import native


def _into(res: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return res
    out.copy_(res)
    return out


@native
def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, out):
    res = reference.mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                               max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)
    return _into(res, out)


@native
def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices, out):
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(context_lens.device).multi_processor_count
    res = reference.paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=indices).to(context_lens.device)
    return _into(res, out)


@native
def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                         logits_dtype, indices, out):
    del schedule_meta  # the reference walks every sequence itself
    res = reference.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits,
                                     logits_dtype=logits_dtype, indices=indices)
    return _into(res, out)


@native
def clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n):
    return reference.clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)

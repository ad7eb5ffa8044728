"""The public ops (SPEC 2). Thin wrappers over deep_indexer._C: validation, allocation and the
launch all happen in C++ on PyTorch's current stream of the inputs' device."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C


def clean_logits(
    logits: torch.Tensor,
    cu_seq_len_k_start: Optional[torch.Tensor],
    cu_seq_len_k_end: torch.Tensor,
    next_n: int = 1,
) -> torch.Tensor:
    """Writes -inf outside each row's key range, in place, and returns `logits` (SPEC 2.4).

    logits: [M, N] float32/bfloat16 (stride(1) == 1, rows may be padded). ks/ke: int32
    [M // next_n]; ks may be None (0). Row r (group g = r // next_n, i = r % next_n) keeps
    columns max(ks[g], 0) <= j < min(ke[g] - next_n + i + 1, N).
    """
    return _C.clean_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, next_n)

"""deep_indexer: SM90 kernels for the DeepSeek Sparse Attention lightning indexer.

Ops: fp8_mqa_logits (prefill), get_paged_mqa_logits_metadata + fp8_paged_mqa_logits (decode over
a paged FP8 or FP4 KV cache), clean_logits, topk_indices (exact top-k of the logits); DeepGEMM's names fp8_fp4_mqa_logits / fp8_fp4_paged_mqa_logits
and get_num_sms / set_num_sms (module deep_indexer.deep_gemm, which also holds install()). Kernels are
compiled on first use by a C++ JIT (nvcc, sm_90a) and cached on disk; see `python -m deep_indexer
--help` and docs/api.md.
"""
import torch  # noqa: F401  (loads libtorch/libc10 before the extension)

import deep_indexer._C as _C
from ._paths import cutlass_include_dir as _cutlass_include_dir, include_dir as _include_dir

_C.configure_jit(str(_include_dir()), _cutlass_include_dir())

from . import quant, reference, torch_ops  # noqa: E402, F401  (torch_ops registers torch.ops.deep_indexer.*)
from . import training  # noqa: E402, F401  (autograd ops for training the indexer, portable PyTorch)
from .jit import cache_clear, cache_info, precompile  # noqa: E402
from .ops import clean_logits, fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata, topk_indices  # noqa: E402
from . import deep_gemm  # noqa: E402
from .deep_gemm import fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits, get_num_sms, set_num_sms  # noqa: E402
from .ops import fp8_mqa_topk_indices, fp8_paged_mqa_topk_indices, topk_workspace  # noqa: E402

__all__ = [
    "fp8_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_paged_mqa_logits",
    "clean_logits",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_num_sms",
    "set_num_sms",
    "deep_gemm",
    "topk_indices",
    "fp8_mqa_topk_indices",
    "fp8_paged_mqa_topk_indices",
    "topk_workspace",
    "precompile",
    "cache_info",
    "cache_clear",
    "quant",
    "reference",
]
__version__ = "0.1.0"

"""The reference implementation's SM90 prefill logits kernel, callable with its own API, for
side-by-side timing where the reference library is not installed (tools/deepgemm_ref.cu builds the
launcher; see there).

    PYTHONPATH=tools DI_DEEPGEMM_REF_SO=.whl/deepgemm_ref.so python3 -m deep_indexer bench --compare deepgemm_ref ...
    python3 tools/ab.py --compare deepgemm_ref --variants "" 4096:32768:causal:32:128

Only `fp8_mqa_logits` (fp32 logits, full width, H in {32, 64}, D in {64, 128}) is provided.
"""
from __future__ import annotations

import ctypes
import os

import torch

_BLOCK_QH, _BLOCK_KV = 128, 256
_lib = None


def _load():
    global _lib
    if _lib is None:
        path = os.environ.get("DI_DEEPGEMM_REF_SO", os.path.join(os.path.dirname(__file__), "..", ".whl", "deepgemm_ref.so"))
        lib = ctypes.CDLL(os.path.abspath(path))
        u32, u64, p, i = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        lib.dg_mqa_logits.argtypes = [u32, u32, u32, u32, u64, p, p, p, p, p, p, p, i, p]
        lib.dg_clean_logits.argtypes = [u32, u32, u64, p, p, p, i, p]
        _lib = lib
    return _lib


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
                   logits_dtype=torch.float32):
    if max_seqlen_k or logits_dtype != torch.float32:
        raise NotImplementedError("deepgemm_ref: full-width fp32 logits only")
    q = q[0] if isinstance(q, tuple) else q
    k, k_scale = kv
    S, H, D = q.shape
    SKV = k.shape[0]
    block_q = _BLOCK_QH // H
    # NOTES: the kernel stores whole 256-key blocks and whole BLOCK_Q row groups: the buffer has
    # SKV + 256 columns (a multiple of 4) and S rounded up to BLOCK_Q rows, as the reference's.
    stride = (SKV + _BLOCK_KV + 3) // 4 * 4
    rows = (S + block_q - 1) // block_q * block_q
    buf = torch.empty(rows, stride, dtype=torch.float32, device=q.device)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    stream = ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream)
    lib = _load()
    ks, ke = cu_seq_len_k_start.contiguous(), cu_seq_len_k_end.contiguous()
    rc = lib.dg_mqa_logits(H, D, S, SKV, stride, q.data_ptr(), k.data_ptr(), k_scale.data_ptr(),
                           weights.contiguous().data_ptr(), ks.data_ptr(), ke.data_ptr(), buf.data_ptr(), num_sms, stream)
    if rc != 0:
        raise RuntimeError(f"deepgemm_ref: dg_mqa_logits returned {rc} (H={H}, D={D})")
    if clean_logits:
        rc = lib.dg_clean_logits(S, SKV, stride, ks.data_ptr(), ke.data_ptr(), buf.data_ptr(), num_sms, stream)
        if rc != 0:
            raise RuntimeError(f"deepgemm_ref: dg_clean_logits returned {rc}")
    return buf[:S, :SKV]

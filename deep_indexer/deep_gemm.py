"""DeepGEMM's indexer API on deep_indexer's SM90 kernels.

The public names, argument names, argument order and defaults are those of DeepGEMM's indexer entry
points, so code written for `deep_gemm` (positional or keyword calls) runs unchanged:

    fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                       clean_logits=True, max_seqlen_k=0, logits_dtype=torch.float32)
    get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None)
    fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, clean_logits=False, logits_dtype=torch.float32, indices=None)
    fp8_mqa_logits(...), fp8_paged_mqa_logits(...)    (the older names)
    get_num_sms(), set_num_sms(new_num_sms)

deep_indexer's own extras (`out=`, and `logits_dtype` on the older names) are keyword-only. The
signatures are written in deep_indexer._signatures (DEEP_GEMM); tests/test_deep_gemm.py spells
DeepGEMM's out independently.
Both prefill and decode take FP8 and FP4 inputs (DeepGEMM's formats, docs/fp4.md): `q` is `(q_fp8, None)`,
a plain float8_e4m3fn tensor or `(q_fp4, q_sf)`; prefill `kv` is `(k_fp8, k_scale)` or `(k_fp4, k_sf)`;
the decode `kv_cache` is DeepGEMM's FP8 paged cache ([..., D + 4] bytes per token) or its FP4 one
([..., D / 2 + 4]), with either q. Weights may be float32, bfloat16 or float16 (converted to float32 on the
GPU, graph-capturable).

`install()` makes `import deep_gemm` / `from deep_gemm import fp8_fp4_mqa_logits` in an engine
resolve these names to deep_indexer (see its docstring and docs/api.md).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import sysconfig
import types
from typing import Optional

import torch

import deep_indexer._C as _C
from . import _env
from . import ops
from ._signatures import DEEP_GEMM, op as _op

__all__ = [
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_num_sms",
    "set_num_sms",
]

_HALF_WEIGHTS = (torch.bfloat16, torch.float16)


def _float_weights(weights: torch.Tensor, native: tuple = ()) -> torch.Tensor:
    """16-bit weights as float32, except the dtypes in `native` (which the kernel reads itself)."""
    if isinstance(weights, torch.Tensor) and weights.dtype in _HALF_WEIGHTS and weights.dtype not in native:
        return weights.float()
    return weights


# ------------------------------------------------------------------------------------ prefill
def _prefill(op, q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, out):
    # FP8 and FP4 forms of q and kv, in any combination: FP4 is folded into e4m3 (an FP4 q gives float32
    # weights) and (q_fp8, None) unwrapped, then the FP8 op runs.
    q, kv, w = ops._prefill_inputs(op, q, kv, weights)  # (errors name this op)
    w = _float_weights(w, native=(torch.bfloat16,))  # the prefill kernel reads bf16 weights itself
    return ops.fp8_mqa_logits(q, kv, w, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                              max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype, out=out)


@_op(DEEP_GEMM["fp8_fp4_mqa_logits"])
def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, out):
    """Prefill indexer logits, as deep_indexer.fp8_mqa_logits (see docs/api.md).

    q: (q [S, H, D] float8_e4m3fn, None), q, or FP4 (q_fp4 [S, H, D / 2] int8/uint8, q_sf [S, H] int32).
    kv: (k [SKV, D] float8_e4m3fn, k_scale [SKV] float32) or FP4 (k_fp4 [SKV, D / 2], k_sf [SKV] int32).
    FP4 operands are folded exactly into e4m3 for the SM90 FP8 kernel (docs/fp4.md).
    weights: [S, H] float32 or bfloat16 (float16 is converted). max_seqlen_k = 0: logits [S, SKV];
    max_seqlen_k > 0: compressed logits [S, max_seqlen_k] with logits[i, j] = I[i, ks[i] + j].
    """
    return _prefill("fp8_fp4_mqa_logits", q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                    max_seqlen_k, logits_dtype, out)


@_op(DEEP_GEMM["fp8_mqa_logits"])
def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, logits_dtype, out):
    """The older name of fp8_fp4_mqa_logits (same q / kv forms)."""
    return _prefill("fp8_mqa_logits", q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                    max_seqlen_k, logits_dtype, out)


# ------------------------------------------------------------------------------------ decode
@_op(DEEP_GEMM["get_paged_mqa_logits_metadata"])
def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices, out):
    """Decode work split: int32 [num_sms + 1, 2], computed on the GPU (no host sync). num_sms may be None
    (get_num_sms() of the inputs' device). indices: int32 [B] request id per row (varlen batches)."""
    return ops.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=indices, out=out)


def _decode(op, q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
            logits_dtype, indices, out):
    q, q_sf = ops._decode_q(op, q)  # (q_fp8, None) / q_fp8 / (q_fp4, q_sf); errors name this op
    return ops._paged_logits(op, q, q_sf, kv_cache, _float_weights(weights), context_lens, block_table, schedule_meta,
                             max_context_len, clean_logits, logits_dtype, indices, out)


@_op(DEEP_GEMM["fp8_fp4_paged_mqa_logits"])
def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                             logits_dtype, indices, out):
    """Decode indexer logits over a paged cache, as deep_indexer.fp8_paged_mqa_logits (docs/api.md).

    q: (q [B, next_n, H, D] float8_e4m3fn, None), q, or FP4 (q_fp4 [B, next_n, H, D / 2] int8/uint8, q_sf
    [B, next_n, H] int32). kv_cache: uint8 [num_blocks, block_kv, 1, D + 4] (FP8) or [..., D / 2 + 4] (FP4),
    with either q. weights: [B * next_n, H] float32 (bfloat16/float16 are converted).
    Returns [B * next_n, max_context_len]: the logits of the dequantized inputs (docs/fp4.md).
    """
    return _decode("fp8_fp4_paged_mqa_logits", q, kv_cache, weights, context_lens, block_table, schedule_meta,
                   max_context_len, clean_logits, logits_dtype, indices, out)


@_op(DEEP_GEMM["fp8_paged_mqa_logits"])
def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
                         indices, logits_dtype, out):
    """The older name of fp8_fp4_paged_mqa_logits (the same q / kv_cache forms)."""
    return _decode("fp8_paged_mqa_logits", q, kv_cache, weights, context_lens, block_table, schedule_meta,
                   max_context_len, clean_logits, logits_dtype, indices, out)


# ------------------------------------------------------------------------------------ SM count
def _current_device() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def set_num_sms(new_num_sms: int) -> None:
    """Caps the SMs deep_indexer uses, process-wide: the default num_sms of the decode metadata and the
    size of the persistent prefill grid. 1 <= new_num_sms <= the current device's SM count; 0 removes it."""
    if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int):
        raise TypeError(f"deep_indexer.set_num_sms: new_num_sms must be an int, got {type(new_num_sms).__name__}")
    _C.set_num_sms(new_num_sms, _current_device())


def get_num_sms() -> int:
    """The SM count deep_indexer uses on the current device: its SM count, or the set_num_sms cap if smaller."""
    device = _current_device()
    if device < 0:
        cap = _C.get_num_sms(-1)
        if cap:
            return cap
        raise RuntimeError("deep_indexer.get_num_sms: no CUDA device is available (and no set_num_sms cap is set)")
    return _C.get_num_sms(device)


# ------------------------------------------------------------------------------------ install
INDEXER_NAMES = tuple(__all__)
_ORIGINALS = "_deep_indexer_originals"


def install(module_name: str = "deep_gemm") -> types.ModuleType:
    """Routes DeepGEMM's indexer entry points to deep_indexer in this process; returns the module.

    - If `deep_gemm` (DeepGEMM) is importable, replaces exactly the names in INDEXER_NAMES on it and
      leaves everything else (its GEMMs) alone; its set_num_sms then sets both libraries' SM count.
    - Otherwise registers a module `deep_gemm` in sys.modules holding only these names, so that
      `import deep_gemm` / `from deep_gemm import fp8_fp4_mqa_logits` find deep_indexer.
    Call it before the engine imports its DeepGEMM wrappers. Calling it again is a no-op; uninstall()
    undoes it.
    """
    this = sys.modules[__name__]
    existing = sys.modules.get(module_name)
    if existing is not None and getattr(existing, "__deep_indexer__", False):
        return existing
    try:
        real = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        real = None
    if real is not None:
        if getattr(real, _ORIGINALS, None) is None:
            setattr(real, _ORIGINALS, {n: getattr(real, n, None) for n in INDEXER_NAMES})
        originals = getattr(real, _ORIGINALS)
        for name in INDEXER_NAMES:
            setattr(real, name, getattr(this, name))
        if callable(originals.get("set_num_sms")) and callable(originals.get("get_num_sms")):
            setattr(real, "set_num_sms", _both_set_num_sms(originals["set_num_sms"]))
            setattr(real, "get_num_sms", originals["get_num_sms"])
        return real
    stub = types.ModuleType(module_name, "deep_indexer's stand-in for DeepGEMM's indexer API (deep_indexer.deep_gemm)")
    stub.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
    stub.__deep_indexer__ = True
    stub.__all__ = list(INDEXER_NAMES)
    for name in INDEXER_NAMES:
        setattr(stub, name, getattr(this, name))

    def missing(name: str):
        raise AttributeError(f"module '{module_name}' is deep_indexer's stand-in holding DeepGEMM's indexer functions "
                             f"only ({', '.join(INDEXER_NAMES)}); '{name}' needs DeepGEMM itself installed")

    stub.__getattr__ = missing  # getattr(deep_gemm, "fp8_gemm_nt", None) still gives None
    sys.modules[module_name] = stub
    return stub


def uninstall(module_name: str = "deep_gemm") -> None:
    """Undoes install(): restores DeepGEMM's own functions, or removes the stand-in module."""
    mod = sys.modules.get(module_name)
    if mod is None:
        return
    if getattr(mod, "__deep_indexer__", False):
        del sys.modules[module_name]
        return
    originals = getattr(mod, _ORIGINALS, None)
    if originals is not None:
        for name, fn in originals.items():
            if fn is None:
                if hasattr(mod, name):
                    delattr(mod, name)
            else:
                setattr(mod, name, fn)
        delattr(mod, _ORIGINALS)


# ------------------------------------------------------------------------------------ env switch
HOOK_ENV = _env.DEEP_GEMM
HOOK_FILE = "deep_indexer_deep_gemm.pth"
# Run by Python's `site` at every start of this environment's interpreter: only reads the environment
# variable unless it is "1", so processes without it are untouched (torch is not even imported).
HOOK_LINE = (f'import os; os.environ.get("{HOOK_ENV}", "0") == "1" and '
             f'__import__("importlib").import_module("deep_indexer.deep_gemm").install()\n')


def _site_dir(site_dir: Optional[str]) -> str:
    return site_dir or sysconfig.get_paths()["purelib"]


def enable_env_switch(site_dir: Optional[str] = None) -> str:
    """Writes the startup hook (a .pth file in this environment's site-packages, or `site_dir`) with which
    every Python process started with DI_DEEP_GEMM=1 runs install() at start, worker processes included.
    Only `python -m deep_indexer deep-gemm enable` calls this (never the package's installation).
    Returns the file's path."""
    path = os.path.join(_site_dir(site_dir), HOOK_FILE)
    with open(path, "w") as f:
        f.write(HOOK_LINE)
    return path


def disable_env_switch(site_dir: Optional[str] = None) -> Optional[str]:
    """Removes the startup hook; returns its path if there was one."""
    path = os.path.join(_site_dir(site_dir), HOOK_FILE)
    if os.path.exists(path):
        os.remove(path)
        return path
    return None


def _both_set_num_sms(deep_gemm_set_num_sms):
    def set_num_sms(new_num_sms: int) -> None:
        """Sets DeepGEMM's and deep_indexer's SM count."""
        deep_gemm_set_num_sms(new_num_sms)
        globals()["set_num_sms"](new_num_sms)

    return set_num_sms

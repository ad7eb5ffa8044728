"""Input validation of every op, on CPU tensors (shape/dtype/stride checks run before the device
check): each bad input raises ValueError naming the argument and the expected vs actual value."""
import pytest
import torch

import deep_indexer as di

FP8 = torch.float8_e4m3fn


def prefill_args(S=4, H=64, D=128, SKV=16):
    q = torch.randn(S, H, D).to(FP8)
    k = torch.randn(SKV, D).to(FP8)
    return dict(q=q, kv=(k, torch.rand(SKV)), weights=torch.randn(S, H),
                cu_seq_len_k_start=torch.zeros(S, dtype=torch.int32), cu_seq_len_k_end=torch.full((S,), SKV, dtype=torch.int32))


def paged_args(B=2, next_n=1, H=64, D=128, block=64, blocks=4):
    return dict(q=torch.randn(B, next_n, H, D).to(FP8),
                kv_cache=torch.randint(0, 255, (blocks, block, 1, D + 4), dtype=torch.uint8),
                weights=torch.randn(B * next_n, H), context_lens=torch.full((B,), 100, dtype=torch.int32),
                block_table=torch.zeros(B, 2, dtype=torch.int32), schedule_meta=torch.zeros(5, 2, dtype=torch.int32),
                max_context_len=128)


def call_prefill(**over):
    a = prefill_args()
    a.update(over)
    return di.fp8_mqa_logits(a["q"], a["kv"], a["weights"], a["cu_seq_len_k_start"], a["cu_seq_len_k_end"],
                             **{k: v for k, v in over.items() if k in ("logits_dtype", "out", "max_seqlen_k")})


def call_paged(**over):
    a = paged_args()
    a.update(over)
    extra = {k: a.pop(k) for k in ("logits_dtype", "out", "indices") if k in a}
    return di.fp8_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                                   a["schedule_meta"], a["max_context_len"], **extra)


@pytest.mark.parametrize("over,pattern", [
    (dict(q=torch.randn(4, 64, 128)), r"q must have dtype Float8_e4m3fn, got Float"),
    (dict(q=torch.randn(4, 64, 128, 1).to(FP8)), r"q must be 3-D, got shape \[4, 64, 128, 1\]"),
    (dict(q=torch.randn(4, 48, 128).to(FP8)), r"48 heads of dim 128; supported"),
    (dict(q=torch.randn(4, 64, 96).to(FP8)), r"64 heads of dim 96"),
    (dict(q=torch.randn(4, 128, 64).to(FP8).transpose(1, 2)), r"q must be contiguous"),
    (dict(kv=(torch.randn(16, 64).to(FP8), torch.rand(16))), r"kv\[0\] \(k\) must have shape \[\*, 128\], got \[16, 64\]"),
    (dict(kv=(torch.randn(16, 128).to(FP8), torch.rand(15))), r"kv\[1\] \(k_scale\) must have shape \[16\], got \[15\]"),
    (dict(kv=(torch.randn(16, 128).to(FP8), torch.rand(16).double())), r"k_scale\) must have dtype Float, got Double"),
    (dict(kv=(torch.randn(0, 128).to(FP8), torch.rand(0))), r"1 <= SKV"),
    (dict(kv=torch.randn(16, 128).to(FP8)), r"kv must be a tuple"),
    (dict(weights=torch.randn(4, 32)), r"weights must have shape \[4, 64\], got \[4, 32\]"),
    (dict(weights=torch.randn(64, 4).t()), r"weights must have stride 1 in its last dimension"),
    (dict(weights=torch.randn(4, 64).half()), r"weights must have dtype Float or BFloat16, got Half"),
    (dict(weights=torch.randn(64, 4).bfloat16().t()), r"weights must have stride 1 in its last dimension"),
    (dict(max_seqlen_k=-1), r"max_seqlen_k must be 0 \(full-width logits\) or in 1\.\.\d+, got -1"),
    (dict(max_seqlen_k=2**31), r"max_seqlen_k must be 0 \(full-width logits\) or in 1\.\.\d+, got 2147483648"),
    (dict(cu_seq_len_k_start=torch.zeros(4, dtype=torch.int64)), r"cu_seq_len_k_start must have dtype Int, got Long"),
    (dict(cu_seq_len_k_end=torch.zeros(5, dtype=torch.int32)), r"cu_seq_len_k_end must have shape \[4\], got \[5\]"),
    (dict(logits_dtype=torch.float16), r"logits_dtype must be torch.float32 or torch.bfloat16"),
    (dict(), r"q must be on a CUDA device, got cpu"),
])
def test_prefill_validation(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        call_prefill(**over)


def test_prefill_out_validation():
    with pytest.raises(ValueError, match=r"out must have shape \[4, 16\], got \[4, 15\]"):
        call_prefill(out=torch.empty(4, 15))
    # compressed logits: out is [S, max_seqlen_k]
    with pytest.raises(ValueError, match=r"out must have shape \[4, 5\], got \[4, 16\]"):
        call_prefill(out=torch.empty(4, 16), max_seqlen_k=5)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an int, got float"):
        call_prefill(max_seqlen_k=5.0)
    with pytest.raises(TypeError):  # keyword-only
        a = prefill_args()
        di.fp8_mqa_logits(a["q"], a["kv"], a["weights"], a["cu_seq_len_k_start"], a["cu_seq_len_k_end"], True, 5)
    with pytest.raises(ValueError, match=r"out must have dtype BFloat16, got Float"):
        call_prefill(out=torch.empty(4, 16), logits_dtype=torch.bfloat16)


@pytest.mark.parametrize("over,pattern", [
    (dict(q=torch.randn(2, 1, 64, 128)), r"q must have dtype Float8_e4m3fn"),
    (dict(q=torch.randn(2, 9, 64, 128).to(FP8), weights=torch.randn(18, 64)), r"1 <= next_n <= 8, got next_n = 9"),
    (dict(q=torch.randn(2, 1, 64, 32).to(FP8)), r"64 heads of dim 32; supported: heads 16/32/64/128, dims 64/128"),
    (dict(kv_cache=torch.zeros(4, 64, 1, 128, dtype=torch.uint8)),
     r"kv_cache rows must hold D \+ 4 = 132 bytes \(the FP8 cache\) or D / 2 \+ 4 = 68 bytes \(the FP4 cache\) "
     r"for D = 128 \(from q\), got 128 \(kv_cache shape \[4, 64, 1, 128\]\)"),
    (dict(kv_cache=torch.zeros(4, 16, 1, 132, dtype=torch.uint8)), r"blocks must hold 32 or 64 tokens, got 16"),
    (dict(kv_cache=torch.zeros(4, 64, 1, 132, dtype=torch.int8)), r"kv_cache must have dtype Byte, got Char"),
    (dict(kv_cache=torch.zeros(4, 64, 1, 140, dtype=torch.uint8)[..., :132]), r"contiguous inside each block"),
    (dict(weights=torch.randn(3, 64)), r"weights must have shape \[2, 64\], got \[3, 64\]"),
    (dict(weights=torch.randn(2, 66)[:, :64]), r"weights row stride must be a multiple of 4 elements \(16 bytes\), got 66"),
    (dict(context_lens=torch.zeros(3, dtype=torch.int32)), r"context_lens must have 2 rows \(the batch of q\), got 3"),
    (dict(context_lens=torch.zeros(2, 2, dtype=torch.int32)), r"context_lens \[B, next_n\] must have next_n = 1 \(from q\), got 2"),
    (dict(context_lens=torch.zeros(2, dtype=torch.int64)), r"context_lens must have dtype Int, got Long"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), r"block_table must have 2 rows"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), r"block_table must have dtype Int"),
    (dict(schedule_meta=torch.zeros(5, 3, dtype=torch.int32)), r"schedule_meta must be \[num_sms \+ 1, 2\]"),
    (dict(max_context_len=-1), r"max_context_len must be in \[0, 2\^31\), got -1"),
    (dict(), r"q must be on a CUDA device, got cpu"),
    (dict(indices=torch.zeros(2, dtype=torch.int64)), r"indices must have dtype Int, got Long"),
    (dict(indices=torch.zeros(3, dtype=torch.int32)), r"indices must be \[R\] with R = 2 \(one request id per q row\), got shape \[3\]"),
    (dict(indices=torch.zeros(2, 1, dtype=torch.int32)), r"indices must be 1-D, got shape \[2, 1\]"),
    (dict(indices=torch.zeros(4, dtype=torch.int32)[::2]), r"indices must be contiguous"),
    (dict(q=torch.randn(2, 2, 64, 128).to(FP8), weights=torch.randn(4, 64), indices=torch.zeros(2, dtype=torch.int32)),
     r"with indices \(varlen\), q must be \[R, 1, H, D\].*got next_n = 2"),
    (dict(context_lens=torch.zeros(2, 1, dtype=torch.int32), indices=torch.zeros(2, dtype=torch.int32)),
     r"q must be on a CUDA device"),
])
def test_paged_validation(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        call_paged(**over)


@pytest.mark.parametrize("args,pattern", [
    ((torch.zeros(3, 5, dtype=torch.float32), 64), r"context_lens must have dtype Int, got Float"),
    ((torch.zeros(3, 9, dtype=torch.int32), 64), r"1 <= next_n <= 8, got 9"),
    ((torch.zeros(3, dtype=torch.int32), 48), r"block_kv must be 32 or 64, got 48"),
    ((torch.zeros(3, dtype=torch.int32), 64), r"context_lens must be on a CUDA device"),
    ((torch.zeros(3, 2, dtype=torch.int32), 64, None, torch.zeros(3, dtype=torch.int32)),
     r"with indices, context_lens must be \[R\] or \[R, 1\]"),
    ((torch.zeros(3, dtype=torch.int32), 64, None, torch.zeros(4, dtype=torch.int32)), r"indices must be \[R\] with R = 3"),
    ((torch.zeros(3, dtype=torch.int32), 64, None, torch.zeros(3, dtype=torch.float32)), r"indices must have dtype Int"),
])
def test_metadata_validation(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        if len(args) == 4:
            di.get_paged_mqa_logits_metadata(*args[:3], indices=args[3])
        else:
            di.get_paged_mqa_logits_metadata(*args)


@pytest.mark.parametrize("args,pattern", [
    ((torch.zeros(4, 8, dtype=torch.float16), None, torch.zeros(4, dtype=torch.int32)), r"logits must have dtype Float or BFloat16, got Half"),
    ((torch.zeros(4, 8), None, torch.zeros(3, dtype=torch.int32)), r"cu_seq_len_k_end must have shape \[4\], got \[3\]"),
    ((torch.zeros(4, 8), torch.zeros(4), torch.zeros(4, dtype=torch.int32)), r"cu_seq_len_k_start must have dtype Int"),
    ((torch.zeros(8, 4).t(), None, torch.zeros(4, dtype=torch.int32)), r"logits must have stride 1"),
    ((torch.zeros(4, 8), None, torch.zeros(4, dtype=torch.int32), 3), r"4 rows, not a multiple of next_n = 3"),
    ((torch.zeros(4, 8), None, torch.zeros(4, dtype=torch.int32), 0), r"next_n must be >= 1"),
    ((torch.zeros(4, 8), None, torch.zeros(4, dtype=torch.int32)), r"logits must be on a CUDA device"),
])
def test_clean_logits_validation(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        di.clean_logits(*args)


def test_paged_out_validation():
    with pytest.raises(ValueError, match=r"out must have shape \[2, 128\], got \[2, 127\]"):
        call_paged(out=torch.empty(2, 127))


# ------------------------------------------------------------------------------------ Python types
# A non-tensor where a tensor is expected, a float where an int is, ...: every public op raises one error
# (a TypeError, also a ValueError) naming the op, the argument, what it expects and what it got, before
# anything reaches the extension (whose own message would be pybind's list of overloads).
from deep_indexer import _signatures, deep_gemm  # noqa: E402

_P = prefill_args()
_D = paged_args()
_LOGITS, _KE = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32)


@pytest.mark.parametrize("call,pattern", [
    (lambda: di.fp8_mqa_logits([1], _P["kv"], _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"]),
     r"deep_indexer.fp8_mqa_logits: q must be a torch.Tensor, a tuple \(q, None\) or an FP4 tuple \(q_fp4, q_sf\), "
     r"got a list of 1"),
    (lambda: di.fp8_mqa_logits(_P["q"], None, _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"]),
     r"kv must be a tuple \(k, k_scale\) of two tensors, got None"),
    (lambda: di.fp8_mqa_logits(_P["q"], (_P["kv"][0], None), _P["weights"], _P["cu_seq_len_k_start"],
                               _P["cu_seq_len_k_end"]), r"kv\[1\] \(k_scale\) must be a torch.Tensor, got None"),
    (lambda: di.fp8_mqa_logits(_P["q"], _P["kv"], _P["weights"], None, _P["cu_seq_len_k_end"]),
     r"cu_seq_len_k_start must be a torch.Tensor, got None"),
    (lambda: di.fp8_mqa_logits(_P["q"], _P["kv"], _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"],
                               "yes"), r"clean_logits must be a bool, got str"),
    (lambda: di.fp8_mqa_logits(_P["q"], _P["kv"], _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"],
                               logits_dtype="float32"), r"logits_dtype must be a torch.dtype, got str"),
    (lambda: di.fp8_mqa_logits(_P["q"], _P["kv"], _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"],
                               out=[0]), r"out must be a torch.Tensor or None, got a list of 1"),
    (lambda: di.fp8_paged_mqa_logits(*list(_D.values())[:6], 128.0),
     r"deep_indexer.fp8_paged_mqa_logits: max_context_len must be an int, got float"),
    (lambda: di.fp8_paged_mqa_logits(*list(_D.values())[:6], True), r"max_context_len must be an int, got bool"),
    (lambda: di.fp8_paged_mqa_logits(*list(_D.values())[:4], [[0]], *list(_D.values())[5:]),
     r"block_table must be a torch.Tensor, got a list of 1"),
    (lambda: di.get_paged_mqa_logits_metadata(_D["context_lens"], 64.0), r"block_kv must be an int, got float"),
    (lambda: di.get_paged_mqa_logits_metadata(_D["context_lens"], 64, "132"), r"num_sms must be an int or None, got str"),
    (lambda: di.clean_logits(_LOGITS, None, [4, 4, 4, 4]), r"cu_seq_len_k_end must be a torch.Tensor, got a list of 4"),
    (lambda: di.clean_logits(_LOGITS, None, _KE, 1.5), r"deep_indexer.clean_logits: next_n must be an int, got float"),
    (lambda: di.topk_indices(_LOGITS, 2.0, None, _KE), r"deep_indexer.topk_indices: k must be an int, got float"),
    (lambda: di.topk_indices(_LOGITS, 2, None, _KE, index_mode=None), r"index_mode must be a str, got None"),
    (lambda: di.topk_indices(_LOGITS, 2, None, _KE, block_size=1.0), r"block_size must be an int or None, got float"),
    (lambda: di.topk_indices(None, 2, None, _KE), r"logits must be a torch.Tensor, got None"),
    (lambda: di.fp8_mqa_topk_indices(_P["q"], _P["kv"], _P["weights"], _P["cu_seq_len_k_start"], _P["cu_seq_len_k_end"],
                                     None), r"deep_indexer.fp8_mqa_topk_indices: k must be an int, got None"),
    (lambda: di.fp8_paged_mqa_topk_indices(*_D.values(), 16, workspace=1), r"workspace must be a torch.Tensor or None"),
    (lambda: di.topk_workspace(4, 8.5), r"deep_indexer.topk_workspace: cols must be an int, got float"),
    (lambda: deep_gemm.fp8_fp4_mqa_logits(None, _P["kv"], _P["weights"], _P["cu_seq_len_k_start"],
                                          _P["cu_seq_len_k_end"]),
     r"deep_indexer.deep_gemm.fp8_fp4_mqa_logits: q must be a torch.Tensor, a tuple \(q, None\) or an FP4 tuple "
     r"\(q_fp4, q_sf\), got None"),
    (lambda: deep_gemm.fp8_paged_mqa_logits(*list(_D.values())[:6], None),
     r"deep_indexer.deep_gemm.fp8_paged_mqa_logits: max_context_len must be an int, got None"),
    (lambda: deep_gemm.get_paged_mqa_logits_metadata(_D["context_lens"], 64, 1.5),
     r"num_sms must be an int or None, got float"),
])
def test_wrong_python_types_are_named(call, pattern):
    with pytest.raises(_signatures.ArgumentTypeError, match=pattern) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert "incompatible function arguments" not in str(info.value)


def test_integer_likes_are_accepted():
    """numpy integers, 0-dim integer tensors and 0 / 1 for bools pass the type check (the op then fails on
    the CPU tensors, past the check)."""
    np = pytest.importorskip("numpy")
    for n in (np.int64(128), torch.tensor(128)):
        with pytest.raises(ValueError, match="CUDA device"):
            di.fp8_paged_mqa_logits(*list(_D.values())[:6], n, np.bool_(False))
    with pytest.raises(ValueError, match="CUDA device"):
        di.clean_logits(_LOGITS, None, _KE, np.int32(1))
    with pytest.raises(ValueError, match="CUDA device"):
        di.fp8_mqa_logits(*_P.values(), 1)


@pytest.mark.parametrize("module,views", [(di, None), (deep_gemm, _signatures.DEEP_GEMM),
                                          (di.reference, _signatures.REFERENCE)])
def test_functions_have_their_views_signature(module, views):
    """Each public function's signature is the one _signatures builds (inspect / help() show it)."""
    import inspect

    views = views or {n: _signatures.View(n) for n in ("clean_logits", "fp8_mqa_logits",
                                                        "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits",
                                                        "topk_indices", "fp8_paged_mqa_topk_indices",
                                                        "fp8_mqa_topk_indices", "topk_workspace")}
    for name, view in views.items():
        assert inspect.signature(getattr(module, name)) == _signatures.signature(view), name

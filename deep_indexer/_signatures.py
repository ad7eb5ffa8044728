"""Every public op's signature, written once.

The stubs below are the ops' native signatures (deep_indexer.<op>). Every other form of an op is a
`View` of its stub: the same arguments (names, types, defaults) in another order or with another
keyword-only boundary, plus the few differences listed with it (DEEP_GEMM: DeepGEMM's names, whose
order and defaults engines depend on; TORCH_OPS: torch.ops.deep_indexer.*; REFERENCE: the plain
PyTorch reference). deep_indexer.baseline has the native signatures. `op(view)(impl)` turns an implementation into the public function: one with the
view's exact signature (as `inspect.signature` and help() show it) that checks the Python type of
every argument, raising `ArgumentTypeError` (a TypeError, and a ValueError as the ops' other input
errors are) that names the op, the argument, what it expects and what it got, and then calls
`impl` with every argument by position in the view's order (impl's parameter names must be those
names in that order: checked when the module is imported).

The functions are generated as source and compiled once (as dataclasses does for __init__) so that
a call costs one plain Python call plus an isinstance per argument, nothing per call like
inspect.Signature.bind. Type checks are skipped while torch.compile traces (the custom ops' schemas
check there).
"""

import dataclasses
import inspect
import operator
from typing import Callable, Optional, Union

import torch
from torch import Tensor

KV = tuple[Tensor, Tensor]  # (k [SKV, D] fp8, k_scale [SKV] float32) or FP4 (k_fp4 [SKV, D / 2], k_sf [SKV] int32)
QInput = Union[Tensor, tuple]  # q of every logits op: a tensor, (q, None) or FP4 (q_fp4, q_sf int32)
REQUIRED = inspect.Parameter.empty


# ------------------------------------------------------------------------------------ native signatures
def clean_logits(logits: Tensor, cu_seq_len_k_start: Optional[Tensor], cu_seq_len_k_end: Tensor,
                 next_n: int = 1) -> Tensor: ...


def fp8_mqa_logits(q: QInput, kv: KV, weights: Tensor, cu_seq_len_k_start: Tensor, cu_seq_len_k_end: Tensor,
                   clean_logits: bool = True, *, max_seqlen_k: int = 0, logits_dtype: torch.dtype = torch.float32,
                   out: Optional[Tensor] = None) -> Tensor: ...


def get_paged_mqa_logits_metadata(context_lens: Tensor, block_kv: int, num_sms: Optional[int] = None, *,
                                  indices: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor: ...


def fp8_paged_mqa_logits(q: QInput, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                         schedule_meta: Tensor, max_context_len: int, clean_logits: bool = False, *,
                         logits_dtype: torch.dtype = torch.float32, indices: Optional[Tensor] = None,
                         out: Optional[Tensor] = None) -> Tensor: ...


def topk_indices(logits: Tensor, k: int, cu_seq_len_k_start: Optional[Tensor] = None,
                 cu_seq_len_k_end: Optional[Tensor] = None, *, context_lens: Optional[Tensor] = None, next_n: int = 1,
                 sorted: bool = False, index_mode: str = "relative", block_table: Optional[Tensor] = None,
                 block_size: Optional[int] = None, row_offset: Optional[Tensor] = None, return_values: bool = False,
                 out: Optional[Tensor] = None, out_values: Optional[Tensor] = None,
                 indices: Optional[Tensor] = None): ...


def fp8_paged_mqa_topk_indices(q: QInput, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                               schedule_meta: Tensor, max_context_len: int, k: int, *, sorted: bool = False,
                               index_mode: str = "relative", row_offset: Optional[Tensor] = None,
                               return_values: bool = False, logits_dtype: torch.dtype = torch.float32,
                               workspace: Optional[Tensor] = None, out: Optional[Tensor] = None,
                               out_values: Optional[Tensor] = None, indices: Optional[Tensor] = None): ...


def fp8_mqa_topk_indices(q: QInput, kv: KV, weights: Tensor, cu_seq_len_k_start: Tensor, cu_seq_len_k_end: Tensor,
                         k: int, *, sorted: bool = False, index_mode: str = "relative",
                         row_offset: Optional[Tensor] = None, return_values: bool = False,
                         logits_dtype: torch.dtype = torch.float32, chunk_rows: Optional[int] = None,
                         workspace: Optional[Tensor] = None, out: Optional[Tensor] = None,
                         out_values: Optional[Tensor] = None, overlap: bool = True): ...


def topk_workspace(rows: int, cols: int, logits_dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None) -> Tensor: ...


# ------------------------------------------------------------------------------------ other forms
@dataclasses.dataclass(frozen=True)
class View:
    """Another form of the stub named `op`: `order` lists the argument names ("*" before the keyword-only
    ones; None: the stub's own signature). `required`: arguments that have no default here; `types`:
    arguments whose type differs here; `extra`: arguments only this form has, name -> (type, default)."""
    op: str
    order: Optional[str] = None
    required: tuple = ()
    types: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)
    returns: object = REQUIRED  # REQUIRED: the stub's


_PREFILL = "q kv weights cu_seq_len_k_start cu_seq_len_k_end clean_logits"
_PAGED = "q kv_cache weights context_lens block_table schedule_meta max_context_len clean_logits"

# deep_indexer.deep_gemm: DeepGEMM's indexer entry points (its argument order and defaults; our extras
# keyword-only and last). q may be a tensor, (q, None) or FP4 (q_fp4, q_sf) everywhere.
DEEP_GEMM = {
    "fp8_fp4_mqa_logits": View("fp8_mqa_logits", f"{_PREFILL} max_seqlen_k logits_dtype * out"),
    "fp8_mqa_logits": View("fp8_mqa_logits", f"{_PREFILL} max_seqlen_k * logits_dtype out"),
    "get_paged_mqa_logits_metadata": View("get_paged_mqa_logits_metadata", "context_lens block_kv num_sms indices * out",
                                          required=("num_sms",)),
    "fp8_fp4_paged_mqa_logits": View("fp8_paged_mqa_logits", f"{_PAGED} logits_dtype indices * out"),
    "fp8_paged_mqa_logits": View("fp8_paged_mqa_logits", f"{_PAGED} indices * logits_dtype out"),
}

# torch.ops.deep_indexer.* (deep_indexer.torch_ops): every argument positional, kv as two tensors, a decode
# q as its tensor plus q_sf (None: FP8 q; int32 [B, next_n, H]: q holds FP4 codes as uint8), no Python-only
# options; the *_out ops and clean_logits write into an argument and return None.
_K = {"k": (Tensor, REQUIRED), "k_scale": (Tensor, REQUIRED)}
_Q_SF = {"q_sf": (Optional[Tensor], None)}
_TOPK = ("logits k cu_seq_len_k_start cu_seq_len_k_end context_lens next_n sorted index_mode block_table block_size "
         "row_offset")
TORCH_OPS = {
    "fp8_mqa_logits": View("fp8_mqa_logits", "q k k_scale weights cu_seq_len_k_start cu_seq_len_k_end clean_logits "
                           "logits_dtype max_seqlen_k", types={"q": Tensor}, extra=_K),
    "fp8_mqa_logits_out": View("fp8_mqa_logits", "q k k_scale weights cu_seq_len_k_start cu_seq_len_k_end "
                               "clean_logits out max_seqlen_k", required=("clean_logits", "out"),
                               types={"q": Tensor, "out": Tensor}, extra=_K, returns=None),
    "get_paged_mqa_logits_metadata": View("get_paged_mqa_logits_metadata", "context_lens block_kv num_sms indices"),
    "get_paged_mqa_logits_metadata_out": View("get_paged_mqa_logits_metadata", "context_lens block_kv out indices",
                                              required=("out",), types={"out": Tensor}, returns=None),
    "fp8_paged_mqa_logits": View("fp8_paged_mqa_logits", f"{_PAGED} logits_dtype indices q_sf",
                                 types={"q": Tensor}, extra=_Q_SF),
    "fp8_paged_mqa_logits_out": View("fp8_paged_mqa_logits", f"{_PAGED} out indices q_sf",
                                     required=("clean_logits", "out"), types={"q": Tensor, "out": Tensor},
                                     extra=_Q_SF, returns=None),
    "clean_logits": View("clean_logits", returns=None),
    "topk_indices": View("topk_indices", f"{_TOPK} indices", extra={"block_size": (int, 0)}, returns=Tensor),
    "topk_indices_out": View("topk_indices", f"{_TOPK} out out_values indices",
                             required=tuple(_TOPK.split()) + ("out", "out_values"),
                             types={"block_size": int, "out": Tensor}, returns=None),
}

# deep_indexer.reference: no out= / schedule, the accumulation dtype and the chunk size as extras (the
# reference checks its arguments itself, strictly: it is built with checks=False)
_REF_EXTRA = {"accum_dtype": (torch.dtype, torch.float32), "chunk": (Optional[int], None)}
REFERENCE = {
    "mqa_logits": View("fp8_mqa_logits", f"{_PREFILL} * max_seqlen_k logits_dtype accum_dtype chunk", extra=_REF_EXTRA),
    "paged_mqa_logits": View("fp8_paged_mqa_logits", "q kv_cache weights context_lens block_table max_context_len "
                             "clean_logits * logits_dtype accum_dtype chunk indices", extra=_REF_EXTRA),
    "clean_logits": View("clean_logits"),
    "paged_mqa_logits_metadata": View("get_paged_mqa_logits_metadata", "context_lens block_kv num_sms split_kv indices",
                                      required=("num_sms",), types={"num_sms": int},
                                      extra={"split_kv": (int, 256)}),
    "topk_indices": View("topk_indices", "logits k cu_seq_len_k_start cu_seq_len_k_end * context_lens next_n sorted "
                         "index_mode block_table block_size row_offset return_values indices"),
}


def signature(view: View) -> inspect.Signature:
    """The full signature of a view (names, kinds, defaults, annotations)."""
    stub = inspect.signature(globals()[view.op])
    params = stub.parameters
    if view.order is not None:
        names = view.order.split()
    else:
        names = []
        for p in params.values():
            if p.kind == p.KEYWORD_ONLY and "*" not in names:
                names.append("*")
            names.append(p.name)
    out, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for n in names:
        if n == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        if n in view.extra:
            tp, default = view.extra[n]
        else:
            tp, default = params[n].annotation, params[n].default
        tp = view.types.get(n, tp)
        if n in view.required:
            default = REQUIRED
        out.append(inspect.Parameter(n, kind, default=default, annotation=tp))
    return inspect.Signature(out, return_annotation=stub.return_annotation if view.returns is REQUIRED
                             else view.returns)


# ------------------------------------------------------------------------------------ type checks
class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong Python type (a list or None for a tensor, a float for an int, ...)."""


_EXPECTED = {  # annotation -> (what the message says it expects, check statement template)
    Tensor: ("a torch.Tensor", "if not isinstance({a}, _Tensor): _bad({i}, {a})"),
    Optional[Tensor]: ("a torch.Tensor or None", "if {a} is not None and not isinstance({a}, _Tensor): _bad({i}, {a})"),
    int: ("an int", "if type({a}) is not int: {a} = _int({i}, {a})"),
    Optional[int]: ("an int or None", "if {a} is not None and type({a}) is not int: {a} = _int({i}, {a})"),
    bool: ("a bool", "if type({a}) is not bool: {a} = _bool({i}, {a})"),
    str: ("a str", "if type({a}) is not str: _bad({i}, {a})"),
    torch.dtype: ("a torch.dtype", "if not isinstance({a}, _dtype): _bad({i}, {a})"),
    Optional[torch.device]: ("a torch.device, str, int or None", ""),  # torch checks it itself
    KV: ("a tuple (k, k_scale) of two tensors",
         "if type({a}) is not tuple or len({a}) != 2 or not isinstance({a}[0], _Tensor) or not isinstance({a}[1], _Tensor): "
         "{a} = _kv({i}, {a})"),
    QInput: ("a torch.Tensor, a tuple (q, None) or an FP4 tuple (q_fp4, q_sf)",
             "if not isinstance({a}, _Tensor) and (not isinstance({a}, (tuple, list)) or len({a}) != 2): _bad({i}, {a})"),
}


def _got(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class _Checker:
    """The slow path of a failed fast check: converts what is acceptable, else raises naming the argument."""

    def __init__(self, qualname: str, params: list):
        self.qualname = qualname
        self.params = params

    def bad(self, i: int, value):
        p = self.params[i]
        raise ArgumentTypeError(f"{self.qualname}: {p.name} must be {_EXPECTED[p.annotation][0]}, got {_got(value)}")

    def int(self, i: int, value):
        if isinstance(value, torch.SymInt):
            return value
        if not isinstance(value, (bool, float)):
            try:
                return operator.index(value)  # numpy integers, 0-dim integer tensors
            except TypeError:
                pass
        self.bad(i, value)

    def bool(self, i: int, value):
        numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
        if numpy_bool or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        self.bad(i, value)

    def kv(self, i: int, value):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            self.bad(i, value)
        for j, part in enumerate(value):
            if not isinstance(part, Tensor):
                raise ArgumentTypeError(f"{self.qualname}: {self.params[i].name}[{j}] ({('k', 'k_scale')[j]}) must be "
                                        f"a torch.Tensor, got {_got(part)}")
        return tuple(value)


def _source(name: str, sig: inspect.Signature, checks: bool) -> str:
    params, star = [], False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name if p.default is REQUIRED else f"{p.name}=_defaults[{p.name!r}]")
    lines = [f"def {name}({', '.join(params)}):"]
    body = [_EXPECTED[p.annotation][1].format(a=p.name, i=i) for i, p in enumerate(sig.parameters.values())]
    body = [b for b in body if b]
    if checks and body:
        lines.append("    if not _compiling():")
        lines += [f"        {b}" for b in body]
    lines.append(f"    return _impl({', '.join(sig.parameters)})")
    return "\n".join(lines) + "\n"


def op(view: View, checks: bool = True, name: Optional[str] = None) -> Callable[[Callable], Callable]:
    """Decorator: the public function of `view` around `impl` (see the module's docstring). Its name,
    docstring and module are impl's (name: `name` if given)."""
    sig = signature(view)

    def build(impl: Callable) -> Callable:
        fname = name or impl.__name__
        want = list(sig.parameters)
        have = list(inspect.signature(impl).parameters)
        if have != want:
            raise TypeError(f"{impl.__module__}.{impl.__qualname__}: parameters {have} differ from the signature's "
                            f"{want} ({view})")
        prefix = "deep_indexer" if impl.__module__ == "deep_indexer.ops" else impl.__module__
        checker = _Checker(f"{prefix}.{fname}", list(sig.parameters.values()))
        ns = {"_impl": impl, "_defaults": {p.name: p.default for p in sig.parameters.values()},
              "_compiling": torch.compiler.is_compiling, "_Tensor": Tensor, "_dtype": torch.dtype,
              "_bad": checker.bad, "_int": checker.int, "_bool": checker.bool, "_kv": checker.kv}
        exec(compile(_source(fname, sig, checks), f"<deep_indexer signature of {fname}>", "exec"), ns)  # noqa: S102
        fn = ns[fname]
        fn.__doc__ = impl.__doc__
        fn.__module__ = impl.__module__
        fn.__qualname__ = fname
        fn.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}
        if sig.return_annotation is not inspect.Signature.empty:
            fn.__annotations__["return"] = sig.return_annotation
        return fn

    return build


def native(impl: Callable) -> Callable:
    """Decorator: the native public op named like `impl` (its stub's signature)."""
    return op(View(impl.__name__))(impl)

"""Training the lightning indexer: indexer logits with autograd and the KL losses against a frozen attention.

    indexer_logits          I[t, s] = sum_h w[t, h] relu(q_I[t, h] . k_I[s]), with backward
    indexer_kl_loss         warm-up stage: KL(attention target || softmax(I)) over all valid keys
    sparse_indexer_kl_loss  sparse stage: the same over given top-k key sets
    packed_bounds           per-row key ranges for packed (causal) sequences, incl. context parallelism

These ops run everywhere PyTorch runs (CPU or GPU): chunked, online (flash-attention style) PyTorch code
that never forms a [T, T] tensor. `reference` holds that compute. On SM90 GPUs the warm-up loss's `mean`
target and the indexer logits backward run on Hopper kernels where the shapes allow (`sm90`, backend="auto").
They trace under torch.compile(fullgraph=True) through custom ops (torch.ops.deep_indexer.*, registered by
`torch_ops`); the non-tensor arguments are constants of the compiled program.
"""
from . import reference
from .ops import KLLoss, indexer_kl_loss, indexer_logits, packed_bounds, sparse_indexer_kl_loss

__all__ = ["indexer_logits", "indexer_kl_loss", "sparse_indexer_kl_loss", "packed_bounds", "KLLoss", "reference"]

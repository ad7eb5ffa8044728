"""deep_indexer: SM90 kernels for the DeepSeek Sparse Attention lightning indexer."""

"""Environment switches read in Python, named once (the C++ extension's are in csrc/utils/env.hpp).
docs/api.md documents each: user-facing, or in its "Tuning and test switches" list."""

DEEP_GEMM = "DI_DEEP_GEMM"  # 1: the startup hook of `python -m deep_indexer deep-gemm enable` runs install()
CUTLASS_INCLUDE = "DI_CUTLASS_INCLUDE"  # CUTLASS/CuTe include folder (else the nvidia-cutlass wheel's)
BENCH_COMMIT = "DI_BENCH_COMMIT"  # bench: the commit to record for a tree copied without its .git
TEST_ALL_VARIANTS = "DI_TEST_ALL_VARIANTS"  # tests: sm_90a compile of the variants (unset: a sample, 1: all, 0: none)
TEST_SEED = "DEEP_INDEXER_TEST_SEED"  # tests: the seed of the randomized reference tests (else a fresh one)

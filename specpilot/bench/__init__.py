"""The suites ``specpilot bench`` runs (:mod:`.cli`): our AR and speculative systems against transformers'
``generate`` with c(N) and the byte floor (:mod:`.engine`, the default); the W12 GEMM against cuBLAS on the
Qwen3-8B / 32B projections plus AR decode with and without W12 (:mod:`.w12`); the certified INT8 head against the
bf16 head (:mod:`.lm_head`); the measured read floor of each projection's bytes (:mod:`.read_floor`). CUDA-graph
timing helpers: :mod:`.timing`. One-off measurement scripts live in ``probes/`` at the repository root; they may
import this package, never the reverse."""

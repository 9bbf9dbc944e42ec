"""GPU benchmark suites shipped with the package (issue 5: ``specpilot bench --suite w12 | lm-head``): the W12 GEMM
against cuBLAS on the Qwen3-8B / 32B projections plus the AR pass with and without W12 (:mod:`.w12`), and the
certified INT8 head against the bf16 head (:mod:`.lm_head`); CUDA-graph timing helpers (:mod:`.timing`). The
scripts under ``probes/`` with the old names call these."""

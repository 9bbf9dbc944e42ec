"""Kernels next to their plain-PyTorch references; see each module's docstring.

The package imports nothing itself: the CPU engine loads `cpu_linear` at module level, and `bench --suite lm-head
--device cpu` must set TRITON_INTERPRET before Triton's first import, so a Triton module loads only where its fast
path is asked for (tests/test_lm_head_bench.py holds that line)."""

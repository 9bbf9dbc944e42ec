"""Kernel classes of the GPU step profile (specpilot.pilot.kernel_profile); the profiler itself is GPU-only."""

import torch

from specpilot.pilot.kernel_profile import _classify_passes, kernel_class


def test_kernel_class_by_name():
    assert kernel_class("nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT") == "projections"
    assert kernel_class("_skinny_gemm_kernel") == "projections"
    assert kernel_class("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "projections"
    assert kernel_class("_tree_attn_fwd") == "attention"
    assert kernel_class("_combine") == "attention"
    assert kernel_class("_add_rmsnorm_kernel") == "norms_elementwise"
    assert kernel_class("_qk_norm_rope_store_kernel") == "norms_elementwise"
    assert kernel_class("Memcpy HtoD (Pageable -> Device)") == "other"


def test_lm_head_is_the_gemm_between_final_norm_and_argmax():
    layer = ["_add_rmsnorm_kernel", "nvjet_a", "_qk_norm_rope_store_kernel", "_tree_attn_fwd", "nvjet_b",
             "_add_rmsnorm_kernel", "nvjet_c", "_silu_mul_kernel", "nvjet_d"]
    one_pass = ["indexSelect", "cos_kernel"] + layer * 2 + ["_add_rmsnorm_kernel", "nvjet_head",
                                                            "reduce_kernel<ArgMaxOps>", "Memcpy DtoH"]
    events = [(t, n, 1.0) for t, n in enumerate(one_pass * 2)]
    got = _classify_passes(events)
    heads = [i for i, (_, c, _) in enumerate(got) if c == "lm_head"]
    assert [got[i][0] for i in heads] == ["nvjet_head", "nvjet_head"]
    assert sum(c == "projections" for _, c, _ in got) == 2 * 2 * 4


def test_isolated_profile_runs_in_a_child_and_reports_its_error():
    """The ceiling's kernel profile runs in a spawned child (the profiler would slow the pilot's own later
    launches); without CUDA the child's own error comes back as one RuntimeError."""
    import pytest

    from specpilot.pilot.kernel_profile import pass_class_fractions_isolated
    from specpilot.zoo import bundled_target_dir

    if torch.cuda.is_available():
        fr = pass_class_fractions_isolated(str(bundled_target_dir()), "float32", "cuda", 4, 32)
        assert abs(sum(fr.values()) - 1.0) < 1e-6
        return
    with pytest.raises(RuntimeError, match="child process failed.*CUDA"):
        pass_class_fractions_isolated(str(bundled_target_dir()), "float32", "cpu", 4, 32)

"""``specpilot.bench.w12`` (``specpilot bench --suite w12``): imports cleanly with the package (the helpers the
read-floor suite and the scripts in ``probes/`` take from it included) and refuses to run without CUDA; its
decode figure and launch records on the CPU. Its measurements need an H200."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_w12_suite_refuses_without_cuda(tmp_path):
    from specpilot.bench import w12

    assert set(w12.SHAPES) >= {"qwen3-8b/qkv", "qwen3-8b/o", "qwen3-8b/gate_up", "qwen3-8b/down"}
    assert all(callable(getattr(w12, f)) for f in ("projection_copies", "copies_of", "check", "codes", "bits_equal"))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        w12.main(str(tmp_path / "w12.json"))
    assert not (tmp_path / "w12.json").exists()


def test_decode_tokens_per_s_times_the_engine_and_compares_tokens(tiny_dirs):
    """The suite's decode figure on a tiny bf16-valued model (CPU, eager; the H200 run uses CUDA graphs): one
    positive tokens/s figure per model, and the W12 copy's tokens equal the plain model's (float32 reference
    path: bitwise the same logits)."""
    from specpilot.bench import w12
    from specpilot.model.checkpoint import load_model
    from specpilot.w12.convert import to_w12, w12_head

    plain = load_model(tiny_dirs[0])
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    packed = to_w12(plain)
    assert w12_head(packed)
    out = w12.decode_tokens_per_s({"bf16": plain, "w12": packed}, prompt_len=6, new_tokens=16, rounds=1)
    assert out["bf16"] > 0 and out["w12"] > 0
    assert out["tokens_equal_bf16"] == {"bf16": True, "w12": True}
    assert out["tokens_sha256"]["bf16"] == out["tokens_sha256"]["w12"] and len(out["tokens_sha256"]["w12"]) == 16


def test_suite_records_the_launch_each_row_takes():
    from specpilot.bench.w12 import launch_config

    one = launch_config(1, 51200, 5120)  # a one-row wide weight goes to the GEMV, which takes no register cap
    assert one["kernel"] == "gemv" and one["lines"] and "maxnreg" not in one
    eight = launch_config(8, 51200, 5120)
    assert eight["kernel"] == "tensor_cores" and eight["maxnreg"] == 80
    assert launch_config(1, 10240, 5120)["kernel"] == "tensor_cores"  # 32B qkv at one row: the tensor cores win

"""``specpilot.bench.w12`` (``specpilot bench --suite w12``): imports cleanly with the package (the helpers the
``probes/`` probes import by name included) and refuses to run without CUDA. Its measurements need an H200."""

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


def test_checked_time_times_only_what_passes_the_check(tmp_path):
    """The probes' check-then-time helper: a wrong output is reported and not timed, a refused launch becomes an
    ``error`` field, and ``write_result`` writes the figures with the elapsed time."""
    import json
    import time

    from specpilot.bench import w12
    from specpilot.w12.format import encode

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(16, 64, generator=g) * 0.02).to(torch.bfloat16)
    t = encode(w)
    x = torch.randn(1, 64, generator=g)
    aw = w.float().abs() + w12.codes(t).abs()
    wrong = w12.checked_time(lambda a, t_, e_: w12.w12_gemm_reference(a, t_) + 1.0, x, t, None, aw, [])
    assert wrong["within_bound"] is False and "us" not in wrong and "error" not in wrong

    def refuse(a, t_, e_):
        raise ValueError("no such launch")

    refused = w12.checked_time(refuse, x, t, None, aw, [])
    assert refused == {"error": "ValueError: no such launch"}
    res = w12.write_result({"rows": [wrong, refused]}, time.time() - 2.0, str(tmp_path / "r.json"))
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["rows"][1]["error"].startswith("ValueError")
    assert back["elapsed_s"] == res["elapsed_s"] >= 2.0


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


def test_probe_command_line_refuses_bad_arguments_in_one_line():
    from specpilot.bench import w12

    for argv in (["p"], ["p", "o.json", "ten"], ["p", "o.json", "1", "2"]):
        with pytest.raises(SystemExit, match="usage: python probes/x.py OUT.json"):
            w12.budget_cli(argv, "x.py", 5.0)
    if torch.cuda.is_available():
        assert w12.budget_cli(["p", "o.json"], "x.py", 5.0) == ("o.json", 5.0)
        assert w12.budget_cli(["p", "o.json", "2.5"], "x.py", 5.0) == ("o.json", 2.5)
    else:
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            w12.budget_cli(["p", "o.json", "2.5"], "x.py", 5.0)
    with pytest.raises(SystemExit, match=r"usage: python probes/y.py OUT.json \[PREFIX"):
        w12.prefix_cli(["p"], "y.py", ("qwen3-8b",))
    if torch.cuda.is_available():
        assert w12.prefix_cli(["p", "o.json"], "y.py", ("qwen3-8b",)) == ("o.json", ("qwen3-8b",))
        assert w12.prefix_cli(["p", "o.json", "a", "b"], "y.py", ("qwen3-8b",)) == ("o.json", ("a", "b"))
    else:
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            w12.prefix_cli(["p", "o.json", "qwen3-32b"], "y.py", ("qwen3-8b",))


def test_suite_records_the_launch_each_row_takes():
    from specpilot.bench.w12 import launch_config

    one = launch_config(1, 51200, 5120)  # a one-row wide weight goes to the GEMV, which takes no register cap
    assert one["kernel"] == "gemv" and one["lines"] and "maxnreg" not in one
    eight = launch_config(8, 51200, 5120)
    assert eight["kernel"] == "tensor_cores" and eight["maxnreg"] == 80
    assert launch_config(1, 10240, 5120)["kernel"] == "tensor_cores"  # 32B qkv at one row: the tensor cores win

"""``specpilot bench`` on the CPU with a small random checkpoint: every figure is there and consistent."""

from __future__ import annotations

import json

from specpilot.benchmark import run_bench
from specpilot.zoo.random_ckpt import write_random_checkpoint

from .test_random_ckpt import SMALL


def test_bench_cpu_small(tmp_path):
    ckpt = write_random_checkpoint("qwen3-8b", tmp_path / "ckpt", device="cpu", overrides={**SMALL, "vocab_size": 512})
    res = run_bench(ckpt, device="cpu", dtype="float32", prefix_len=32, new_tokens=12, out_dir=tmp_path / "out",
                    rows=(1, 2, 4, 8))
    files = list((tmp_path / "out").glob("bench_*.json"))
    assert len(files) == 1 and list((tmp_path / "out").glob("bench_*.png"))
    data = json.loads(files[0].read_text())
    for key in ("device", "versions", "commit", "checkpoint", "ar_ms_per_step", "byte_floor_ms", "c", "transformers"):
        assert key in data, key
    assert set(map(int, data["c"])) == {1, 2, 4, 8} and data["c"]["1"] == 1.0
    assert data["byte_floor_ms"] > 0 and data["ar_ms_per_step"] > 0
    # lossless: our AR, our speculative systems and transformers' greedy generate agree in float32
    ours = [s["tokens"] for s in res["systems"]]
    assert ours[0] == ours[2] == ours[3] and ours[1] == ours[0][: len(ours[1])]
    assert res["ar_equals_transformers"]


def test_result_stem_never_overwrites(tmp_path):
    from specpilot.benchmark import result_stem

    first = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    assert first.startswith("bench_qwen3-8b_cpu_")
    (tmp_path / f"{first}.json").write_text("{}")
    second = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    (tmp_path / f"{second}.json").write_text("{}")
    third = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    assert len({first, second, third}) == 3 and second.startswith(first + "_")

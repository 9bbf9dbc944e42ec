"""``specpilot bench`` on the CPU with a small random checkpoint: every figure is there and consistent."""

from __future__ import annotations

import json

from specpilot.bench.engine import run_bench
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
    from specpilot.bench.engine import result_stem

    first = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    assert first.startswith("bench_qwen3-8b_cpu_")
    (tmp_path / f"{first}.json").write_text("{}")
    second = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    (tmp_path / f"{second}.json").write_text("{}")
    third = result_stem(tmp_path, "/x/qwen3-8b", "cpu")
    assert len({first, second, third}) == 3 and second.startswith(first + "_")


def test_transformers_reference_runs_through_eos_like_our_engine():
    """The bench's transformers AR runs exactly n tokens through any EOS, as our engine does with eos_ids=[]:
    with ``min_new_tokens`` (before) transformers masked EOS's logit and picked another token where the bundled
    target emits EOS, so ``ar_equals_transformers`` read false on correct output (fresh-user run 10)."""
    import torch

    from specpilot.bench.engine import _hf
    from specpilot.config import SystemConfig
    from specpilot.model.checkpoint import load_model
    from specpilot.engine.engine import Engine
    from specpilot.zoo import bundled_target_dir

    model = load_model(bundled_target_dir(), "float32", "cpu")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(1, 2000, (64,), generator=g).tolist()  # greedy AR emits EOS (id 0) at token 6 here
    ours = Engine(model, SystemConfig.ar(), None, eos_ids=[]).generate(prompt, 12).tokens
    assert 0 in ours[:-1]  # an EOS with tokens after it: the case in question
    assert _hf(bundled_target_dir(), "float32", "cpu", prompt, 12)["ar"]["tokens"] == ours


def test_bench_console_summary_says_whether_ar_equals_transformers(tmp_path, monkeypatch, capsys):
    """The console summary carries the lossless check, not only the JSON file (fresh-user run 11)."""
    import specpilot.bench.engine as bm

    from .conftest import run_cli

    ckpt = write_random_checkpoint("qwen3-8b", tmp_path / "ckpt", device="cpu", overrides={**SMALL, "vocab_size": 512})
    fake = {"device": "cpu", "ar_ms_per_step": 1.0, "ar_tokens_per_s": 1000.0, "byte_floor_ms": 0.5,
            "percent_of_floor": 50.0, "c": {33: 1.1, 64: 1.2}}
    for equal in (True, False):
        monkeypatch.setattr(bm, "run_bench", lambda *a, **k: {**fake, "ar_equals_transformers": equal})
        code, out, err = run_cli(monkeypatch, capsys, "bench", "--target", str(ckpt), "--device", "cpu",
                                 "--dtype", "float32", "--prefix", "16", "--out", str(tmp_path / "o"))
        assert code == 0 and json.loads(out)["ar_equals_transformers"] is equal, (out, err)
    monkeypatch.setattr(bm, "run_bench", lambda *a, **k: fake)  # --no-transformers: no such key, none printed
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--target", str(ckpt), "--device", "cpu",
                             "--dtype", "float32", "--prefix", "16", "--out", str(tmp_path / "o"), "--no-transformers")
    assert code == 0 and "ar_equals_transformers" not in json.loads(out)

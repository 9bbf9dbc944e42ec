"""Small command-line edges a fresh user met: --out parents, bench threads, bad audit / memory input, w12 verify
--json errors, train-drafter --quiet."""

from __future__ import annotations

import json

from .conftest import run_cli


def _help(monkeypatch, capsys, *cmd) -> str:
    code, out, err = run_cli(monkeypatch, capsys, *cmd, "--help")
    assert code == 0, err
    return " ".join(out.replace("│", " ").split())


def _one_line(code, err, needle):
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, (code, err)


def test_calibrate_out_creates_missing_parents_as_pilot_and_bench_do(monkeypatch, capsys, tmp_path):
    assert "Missing parent directories are created, as pilot's and bench's --out are" in _help(
        monkeypatch, capsys, "calibrate")
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", "--drafter", "ngram", "--out", str(afile / "d" / "c.json"))
    _one_line(code, err, "is a file, so no directory can be made under it")
    out = tmp_path / "a" / "b" / "cal.json"
    code, text, err = run_cli(monkeypatch, capsys, "calibrate", "--drafter", "ngram", "--per-benchmark", "1",
                              "--max-new-tokens", "4", "--depth", "2", "--top-k", "2", "--out", str(out))
    assert code == 0 and out.is_file() and f"wrote {out}" in text, err
    assert json.loads(out.read_text())["depth"] == 2


def test_bench_picks_threads_as_the_pilot_does(monkeypatch, capsys):
    """The systems suite on a CPU with <= 2 cores runs on 1 thread (the pilot's and generate's rule, one helper),
    ``--threads N`` overrides, and the count is printed; set before the timing starts."""
    import pytest
    import torch

    import specpilot.bench.engine as engine
    import specpilot.pilot.setup as setup
    from specpilot.zoo import bundled_target_dir

    keep = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(setup, "available_cores", lambda: 2)
    monkeypatch.setattr(engine, "run_bench", lambda *a, **k: seen.append(torch.get_num_threads()) or {
        "device": "cpu", "threads": torch.get_num_threads(), "ar_ms_per_step": 1.0, "ar_tokens_per_s": 1e3,
        "byte_floor_ms": 0.5, "percent_of_floor": 50.0, "c": {1: 1.0}})
    args = ["bench", "--device", "cpu", "--dtype", "float32", "--target", str(bundled_target_dir()), "--no-transformers"]
    try:
        torch.set_num_threads(2)
        for flag, want in ((None, 1), ("3", 3)):
            code, out, err = run_cli(monkeypatch, capsys, *args, *(["--threads", flag] if flag else []))
            assert code == 0 and json.loads(out)["threads"] == want and seen[-1] == want, err
        code, _, err = run_cli(monkeypatch, capsys, *args, "--threads", "0")
        _one_line(code, err, "--threads")
        if len(seen) != 2:
            pytest.fail(f"bench ran with --threads 0: {seen}")
    finally:
        torch.set_num_threads(keep)


def test_w12_verify_json_error_is_an_object_on_stdout(monkeypatch, capsys, tmp_path):
    """A script reading ``w12 verify --json``'s stdout gets an object naming the error (and status 2), not nothing."""
    (tmp_path / "plain").mkdir()
    for d, needle in ((tmp_path / "nope", "directory not found"), (tmp_path / "plain", "no w12.json")):
        code, out, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
        _one_line(code, err, needle)
        res = json.loads(out)
        assert res == {"directory": str(d), "bit_exact": False, "error": err.strip().removeprefix("error: ")}
    code, out, err = run_cli(monkeypatch, capsys, "w12", "verify", str(tmp_path / "plain"))
    assert code == 2 and out == ""


def test_train_drafter_quiet_hides_transformers_loading_bar(tmp_path, tiny_dirs, capsys):
    """``train-drafter --quiet`` (``quiet`` down to :func:`make_sequences`) showed transformers' "Loading weights" bar
    while the target loads for generation; now it is off for that load only (transformers' switch is restored)."""
    import numpy as np
    from transformers.utils import logging as hf_logging

    from specpilot.spec.train_block import make_sequences

    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(400, dtype=np.int64) % 64)
    assert hf_logging.is_progress_bar_enabled()
    seen = {}
    for quiet in (False, True):
        capsys.readouterr()
        seqs = make_sequences(tiny_dirs[0], tokens, 2, 4, 2, 0, quiet=quiet)
        seen[quiet] = capsys.readouterr().err
        assert seqs.shape == (2, 6) and hf_logging.is_progress_bar_enabled()
    assert "Loading weights" in seen[False] and "Loading weights" not in seen[True], seen


def test_help_at_80_columns_names_every_option_in_full(monkeypatch, capsys):
    """A terminal (or pipe) of 80 columns still shows each flag whole: plain click help, which wraps the help text
    instead of cutting the option column (rich's tables cut ``--allow-edited-system`` to ``--allow-edited-syst…``)."""
    monkeypatch.setenv("COLUMNS", "80")
    serve = _help(monkeypatch, capsys, "serve")
    for flag in ("--allow-edited-system", "--no-allow-edited-system", "--enable-prefix-caching",
                 "--no-enable-prefix-caching"):
        assert flag in serve.split() or f"{flag} " in serve + " ", flag
    assert "…" not in serve and "…" not in _help(monkeypatch, capsys, "pilot")

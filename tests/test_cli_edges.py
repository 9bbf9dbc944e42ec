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

"""Text that is not valid UTF-8 gives one line ``error: ...`` (exit 2), never a traceback: a ``--prompt`` whose
argv bytes are Latin-1 (a real subprocess, so the bytes arrive as Python's surrogate escapes), the same in
process, a file the CLI reads, and the Python helpers of :mod:`specpilot.text` that stand before a tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.errors import PromptError, SpecPilotError
from specpilot.text import check_text, encode_text, read_text

from .conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
LATIN1 = "café au lait, s'il vous plaît".encode("latin-1")  # 0xe9 and 0xee: not UTF-8
ESCAPED = LATIN1.decode("utf-8", "surrogateescape")  # what Python makes of those argv bytes on Linux


def _cli(*args: str | bytes) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUTF8": "1"}
    return subprocess.run([sys.executable, "-m", "specpilot", *args], capture_output=True, timeout=300, env=env)


def _one_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    err = p.stderr.decode("utf-8", "backslashreplace")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("extra", [[], ["--chat"], ["--json"]])
def test_latin1_prompt_in_argv_is_one_line(extra):
    line = _one_line(_cli("generate", "--prompt", LATIN1, "--max-new-tokens", "4", *extra), "--prompt",
                     "not valid UTF-8", "byte 0xe9", "character 4")
    assert "iconv" in line


def test_utf8_prompt_in_argv_still_generates():
    p = _cli("generate", "--prompt", "café au lait".encode("utf-8"), "--max-new-tokens", "4", "--json")
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert len(json.loads(p.stdout)["output_ids"]) >= 1


def test_latin1_prompt_in_process(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", ESCAPED, "--max-new-tokens", "4")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--prompt is not valid UTF-8: byte 0xe9" in lines[0], err
    assert out == ""


def test_a_latin1_file_the_cli_reads_is_one_line(tmp_path):
    """A JSONL file of outputs with a Latin-1 byte (``audit --outputs``): one line naming the file."""
    bad = tmp_path / "outputs.jsonl"
    bad.write_bytes(b'{"prompt_ids": [1, 2], "output_ids": [3], "benchmark": "caf' + b"\xe9" + b'"}\n')
    from specpilot.zoo import bundled_target_dir

    p = _cli("audit", "--target", str(bundled_target_dir()), "--outputs", str(bad))
    _one_line(p, str(bad), "0xe9")


def test_a_latin1_corpus_is_one_line(tmp_path):
    """``zoo tokenizer --corpus`` reads the file as UTF-8 without a check of its own: the CLI's last net makes the
    decode error one line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(LATIN1 + b"\n")
    _one_line(_cli("zoo", "tokenizer", "--corpus", str(corpus), "--out", str(tmp_path / "tok")), "not valid UTF-8",
              "0xe9")
    assert not (tmp_path / "tok").exists()


def test_an_unchecked_decode_error_is_one_line(monkeypatch, capsys):
    """The CLI's last net: a UnicodeError from text a command did not check itself (here raised by the load) is one
    line and exit 2, not a traceback."""
    import specpilot.engine.deployment as deployment

    def load(*a, **k):
        raise UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")

    monkeypatch.setattr(deployment, "Deployment", load)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "hello", "--max-new-tokens", "4")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and lines == ["error: not valid UTF-8: 'utf-8' codec can't decode byte 0xe9 in position 3: "
                                   "invalid continuation byte"], err


def test_check_text():
    assert check_text("café") == "café"
    assert check_text("café".encode("utf-8")) == "café"
    with pytest.raises(PromptError, match=r"--prompt is not valid UTF-8: byte 0xe9 at character 4 .*iconv"):
        check_text(ESCAPED, "--prompt")
    with pytest.raises(PromptError, match=r"byte 0xe9 at byte offset 3"):
        check_text(LATIN1, "prompt 1")
    with pytest.raises(PromptError, match=r"lone surrogate U\+D800 at character 2 \(line 2\)"):
        check_text("\n\ud800")
    with pytest.raises(PromptError, match="must be text"):
        check_text(["a list"])  # type: ignore[arg-type]
    assert issubclass(PromptError, SpecPilotError)  # the CLI prints it as one line, exit 2


def test_encode_text_stops_before_the_tokenizer():
    """The Python path: the bundled tokenizer raises a TypeError from Rust on surrogates; encode_text refuses first
    and otherwise gives the same ids as the tokenizer."""
    from specpilot.model.checkpoint import load_tokenizer
    from specpilot.zoo import bundled_target_dir

    tok = load_tokenizer(bundled_target_dir())
    with pytest.raises(TypeError):
        tok(ESCAPED, add_special_tokens=False)
    with pytest.raises(PromptError, match="request 3 is not valid UTF-8"):
        encode_text(tok, ESCAPED, "request 3")
    assert encode_text(tok, "café au lait") == tok("café au lait", add_special_tokens=False)["input_ids"]
    assert encode_text(tok, "café".encode("utf-8")) == tok("café", add_special_tokens=False)["input_ids"]


def test_read_text(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("café\n", encoding="utf-8")
    bad.write_bytes(b"line one\ncaf\xe9\n")
    assert read_text(good) == "café\n"
    with pytest.raises(PromptError, match=rf"file {bad} is not valid UTF-8: byte 0xe9 at byte offset 12"):
        read_text(bad)
    with pytest.raises(PromptError, match="cannot read"):
        read_text(tmp_path / "missing.txt")

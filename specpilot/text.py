"""Text where it meets a tokenizer: refuse what is not valid UTF-8 with one line, never a traceback.

On Linux, command-line arguments and file names whose bytes are not UTF-8 reach Python as ``str`` with
surrogate escapes (byte ``0xE9`` becomes ``"\\udce9"``; PEP 383), and JSON may hold lone surrogates
(``"\\ud800"``). Such a string cannot be encoded, so the tokenizer fails deep inside (a ``TypeError`` from the
Rust tokenizers, a ``UnicodeEncodeError`` from ``str.encode``). Pass text through :func:`check_text` (or
:func:`encode_text`) before it reaches a tokenizer, and read text files with :func:`read_text`.
"""

from __future__ import annotations

from pathlib import Path

from specpilot.errors import PromptError


def _describe(text: str, start: int) -> str:
    """What is wrong at ``text[start]`` (a character :func:`str.encode` refused) and where, for a one-line error."""
    cp = ord(text[start])
    line = text.count("\n", 0, start) + 1
    where = f"character {start + 1}" + (f" (line {line})" if line > 1 else "")
    if 0xDC80 <= cp <= 0xDCFF:  # a byte the decoder could not read, kept by surrogateescape
        return f"byte 0x{cp - 0xDC00:02x} at {where} (Latin-1 or another legacy encoding?)"
    return f"a lone surrogate U+{cp:04X} at {where}"


def check_text(text: str | bytes, what: str = "the prompt") -> str:
    """``text`` as a ``str`` that encodes as UTF-8 (``bytes`` are decoded as UTF-8).

    Args:
        text: the text, e.g. a ``--prompt`` argument, a line of a prompt file, a request's text.
        what: how the error names it, e.g. ``"--prompt"`` or ``"prompt 3 of FILE"``.
    Raises:
        PromptError: one line naming ``what``, the offending byte (or lone surrogate) and its position;
            ``text`` neither ``str`` nor ``bytes``.
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptError(f"{what} is not valid UTF-8: byte 0x{text[e.start]:02x} at byte offset {e.start} "
                              "(Latin-1 or another legacy encoding?); convert it, e.g. `iconv -f latin1 -t utf-8`") from None
    if not isinstance(text, str):
        raise PromptError(f"{what} must be text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{what} is not valid UTF-8: {_describe(text, e.start)}; convert it, e.g. "
                          "`iconv -f latin1 -t utf-8`") from None
    return text


def encode_text(tokenizer, text: str | bytes, what: str = "the prompt") -> list[int]:
    """Token ids of ``text`` (no special tokens added) after :func:`check_text`.

    Raises:
        PromptError: ``text`` is not valid UTF-8 (one line, see :func:`check_text`).
    """
    return tokenizer(check_text(text, what), add_special_tokens=False)["input_ids"]


def read_text(path: str | Path, what: str | None = None) -> str:
    """The UTF-8 text of the file ``path``.

    Raises:
        PromptError: the file cannot be read, or is not valid UTF-8 (one line naming the file, the byte and its
            offset).
    """
    what = what or f"file {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PromptError(f"cannot read {what}: {e.strerror or e}") from None
    return check_text(data, what)

"""Training text for the bundled target/drafter pair: the Python standard library's source plus GSM8K train.

Never the evaluation prompts (``specpilot/data/prompts``). Documents are joined by :data:`EOS`, so the
tokenizer and the tokenize step can split them back without ambiguity.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sys
import sysconfig
from pathlib import Path

from specpilot.errors import SpecPilotError

EOS = "<|endoftext|>"
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"})
# ../shared/data/corpus/gsm8k_train.jsonl relative to the repository root
DEFAULT_GSM8K = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpus" / "gsm8k_train.jsonl"


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of the standard library, sorted by relative path (deterministic).

    Args:
        root: stdlib directory; default ``sysconfig.get_paths()["stdlib"]`` of the running interpreter.
    Returns:
        Paths, skipping any directory named in :data:`SKIP_DIRS` (test suites, IDLE, lib2to3, site-packages).
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        out += [Path(d) / f for f in files if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def gsm8k_documents(path: str | Path) -> list[str]:
    """GSM8K train problems as ``Question: ...\\nAnswer: ...\\n\\n`` documents, in file order.

    Raises:
        SpecPilotError: if the file is missing or a line is not JSON with ``question`` and ``answer``.
    """
    p = Path(path)
    if not p.is_file():
        raise SpecPilotError(f"GSM8K train file not found: {p} (pass --gsm8k PATH)")
    docs = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            docs.append(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecPilotError(f"{p}:{i}: not a GSM8K record ({e})") from None
    return docs


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build_corpus(
    gsm8k: str | Path = DEFAULT_GSM8K,
    seed: int = 0,
    max_chars: int | None = None,
    stdlib_root: str | Path | None = None,
) -> tuple[str, dict]:
    """Build the corpus text and its metadata.

    Args:
        gsm8k: path of ``gsm8k_train.jsonl``.
        seed: seed of the deterministic document shuffle.
        max_chars: cap on the corpus length in characters (documents after the cap are dropped, the one
            crossing it is cut); None = no cap.
        stdlib_root: override of the stdlib directory (tests).
    Returns:
        ``(text, meta)``: documents joined by :data:`EOS`; meta records the Python version, stdlib path
        and file count, the GSM8K file and its sha256, document counts (before and after the cap), the seed, the cap and the text's sha256.
    Raises:
        SpecPilotError: missing GSM8K file or unreadable records.
    """
    files = stdlib_files(stdlib_root)
    code = [f.read_text(encoding="utf-8", errors="replace").replace(EOS, "") for f in files]
    math_docs = [d.replace(EOS, "") for d in gsm8k_documents(gsm8k)]
    docs = [d for d in code if d.strip()] + math_docs
    random.Random(seed).shuffle(docs)
    text = EOS.join(docs)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars]
    kept = text.count(EOS) + 1 if text else 0
    gpath = Path(gsm8k).resolve()
    meta = {
        "python_version": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(stdlib_root or sysconfig.get_paths()["stdlib"]),
        "stdlib_files": len(files),
        "stdlib_skipped_dirs": sorted(SKIP_DIRS),
        "gsm8k_file": gpath.name,
        "gsm8k_sha256": hashlib.sha256(gpath.read_bytes()).hexdigest(),
        "gsm8k_documents": len(math_docs),
        "documents": len(docs),
        "documents_kept": kept,
        "separator": EOS,
        "seed": seed,
        "max_chars": max_chars,
        "chars": len(text),
        "sha256": sha256_text(text),
    }
    return text, meta


def write_corpus(out_dir: str | Path, **kwargs) -> tuple[Path, dict]:
    """Build the corpus and write ``corpus.txt`` and ``corpus.json`` (metadata) into ``out_dir``.

    Args:
        out_dir: output directory (created).
        **kwargs: passed to :func:`build_corpus`.
    Returns:
        ``(path of corpus.txt, meta)``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text, meta = build_corpus(**kwargs)
    (out / "corpus.txt").write_text(text, encoding="utf-8")
    (out / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out / "corpus.txt", meta


def read_corpus(path: str | Path) -> tuple[str, dict]:
    """Read ``corpus.txt`` and its sibling ``corpus.json`` (``{}`` if absent).

    Raises:
        SpecPilotError: if the corpus file is missing.
    """
    p = Path(path)
    if not p.is_file():
        raise SpecPilotError(f"corpus file not found: {p} (run `specpilot zoo corpus` first)")
    text = p.read_text(encoding="utf-8")
    mp = p.with_suffix(".json")
    meta = json.loads(mp.read_text()) if mp.is_file() else {}
    return text, meta

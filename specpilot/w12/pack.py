"""W12 checkpoint directories: pack any safetensors checkpoint into W12 records (§4.1); the format of the directory.

:func:`pack_dir` converts the linear-layer weights of any safetensors checkpoint directory (one file, or
shards with a ``*.safetensors.index.json``; the engine need not support the model) and copies every other
file unchanged. A tensor is a *linear weight* when it is 2-D floating point, its name ends in ``.weight``,
and the name contains none of ``embed``, ``norm``, ``wte``, ``wpe`` (embeddings are gathered, not
multiplied). ``lm_head.weight`` counts as linear unless ``config.json`` says ``tie_word_embeddings: true``
(then it is an alias of the embedding and stays as it is). Rows are the tensor's first dimension.

Each bf16 linear weight ``NAME`` becomes four tensors in the same shard: ``NAME.w12.records`` (uint8),
``NAME.w12.bases`` (uint8, the rows' window bases packed by :func:`specpilot.w12.format.pack_bases`),
``NAME.w12.esc_idx`` (int32/int64), ``NAME.w12.esc_val`` (int16), see :mod:`specpilot.w12.format`. Format
version 1 (still read) stored one byte a row instead, as ``NAME.w12.base``. A float16/float32 linear weight has no W12 form: it is stored unchanged under
``NAME`` and listed as ``raw`` (its own bits/weight, 16 or 32) in the manifest and in verify's output.

``w12.json`` (the manifest): ``{"format": "specpilot-w12", "version": 1, "record": {...}, "tensors":
{NAME: {"file", "encoding": "w12" | "raw", "dtype", "shape", "sha256", "bytes", "bits_per_weight",
"escapes", "escape_rate"}}, "copied_tensors": {NAME: {"file", "dtype", "shape", "sha256"}}, "files": {PATH:
{"sha256", "bytes"}}, "totals": {...}}``; ``sha256`` is that of the source tensor's bytes. ``copied_tensors``
lists every tensor stored unchanged (embeddings, norms, biases, a tied head); ``files`` every other file written
to the output (``PATH`` relative to it, ``/``-separated; the sha256 of the source file, or of the rewritten
shard index). :func:`~specpilot.w12.verify.verify_dir` and :func:`~specpilot.w12.verify.load_w12_state_dict` check all of them, so a flipped byte anywhere
in the directory is caught and named. Manifests written before these two keys existed are still read: what
they cannot check is reported by ``verify`` (``not_checked``) and warned about at load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from specpilot.fileio import output_dir, save_safetensors
from specpilot.w12.format import (RECORD_BYTES, RECORD_COLS, RECORD_ROWS, W12FormatError, encode, pack_bases, sha256_of,
                                  sha256_of_file)

MANIFEST = "w12.json"
FORMAT, VERSION = "specpilot-w12", 2
PARTS = ("records", "bases", "esc_idx", "esc_val")  # the stored tensors of a W12 weight (version 2)
PARTS_V1 = ("records", "base", "esc_idx", "esc_val")  # version 1: one window byte a row
_SKIP = ("embed", "norm", "wte", "wpe")


def is_linear_weight(name: str, t: torch.Tensor, tied: bool) -> bool:
    """Whether tensor ``name`` (any shape/dtype) is a linear weight that W12 converts (§4.1; rule in the module
    docstring); ``tied``: the config's tie_word_embeddings. Raises nothing."""
    if t.dim() != 2 or not t.is_floating_point() or not name.endswith(".weight"):
        return False
    if any(s in name for s in _SKIP):
        return False
    return not (tied and name.split(".")[-2] == "lm_head")


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """All tensors and the metadata of one safetensors file. Raises W12FormatError when unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise W12FormatError(f"cannot read {path.name}: corrupted or truncated ({msg})") from None


def _files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise W12FormatError(f"no *.safetensors files in {d}")
    return files


def _entry(file: str, enc: str, src: torch.Tensor, stored: int, escapes: int) -> dict:
    n = src.numel()
    return {"file": file, "encoding": enc, "dtype": str(src.dtype).removeprefix("torch."), "shape": list(src.shape),
            "sha256": sha256_of(src), "bytes": stored, "bits_per_weight": 8 * stored / max(n, 1),
            "escapes": escapes, "escape_rate": escapes / max(n, 1)}


def _totals(entries: list[dict]) -> dict:
    n = sum(int(torch.Size(e["shape"]).numel()) for e in entries)
    b, esc = sum(e["bytes"] for e in entries), sum(e["escapes"] for e in entries)
    return {"weights": n, "bytes": b, "escapes": esc, "bits_per_weight": 8 * b / max(n, 1),
            "escape_rate": esc / max(n, 1), "tensors_w12": sum(e["encoding"] == "w12" for e in entries),
            "tensors_raw": sum(e["encoding"] == "raw" for e in entries)}


def pack_dir(src: str | Path, out: str | Path) -> dict:
    """Write the W12 form (§4.1) of checkpoint directory ``src`` to the new or empty directory ``out``.

    Returns:
        The manifest (also written to ``out/w12.json``).
    Raises:
        W12FormatError: ``src`` missing, without safetensors files, already W12, unreadable, or ``out`` not
            empty / the same as ``src``. On any error ``out`` is left as it was (removed when this call made it).
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise W12FormatError(f"source {src} " + ("is a file, not a directory" if src.exists() else "not found"))
    if (src / MANIFEST).exists():
        raise W12FormatError(f"{src} is already a W12 directory ({MANIFEST} present)")
    output_dir(out, empty=True, error=W12FormatError)
    s_res, o_res = src.resolve(), out.resolve()
    if o_res == s_res or s_res in o_res.parents or o_res in s_res.parents:
        raise W12FormatError(f"output {out} and source {src} must not contain one another (the source's files would "
                             "be packed into their own copy)")
    files = _files(src)
    tied = False
    if (src / "config.json").is_file():
        try:
            tied = bool(json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False))
        except (json.JSONDecodeError, AttributeError):
            raise W12FormatError(f"{src / 'config.json'} is not a valid JSON object") from None
    existed = out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _pack_into(src, out, files, tied)
    except BaseException:  # a failed pack leaves nothing behind, so the same command can be run again
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in out.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        raise


def _pack_into(src: Path, out: Path, files: list[Path], tied: bool) -> dict:
    """:func:`pack_dir`'s writing part: ``out`` exists and is empty. Raises W12FormatError."""
    entries, renames, copied = {}, {}, {}
    for f in files:
        tensors, meta = _read_file(f)
        stored = {}
        for name, t in tensors.items():
            if not is_linear_weight(name, t, tied):
                stored[name] = t
                copied[name] = _copied_entry(f.name, t)
                continue
            if t.dtype != torch.bfloat16:
                stored[name] = t
                entries[name] = _entry(f.name, "raw", t, t.numel() * t.element_size(), 0)
                continue
            w = encode(t)
            keys = {f"{name}.w12.records": w.records, f"{name}.w12.bases": pack_bases(w.base),
                    f"{name}.w12.esc_idx": w.esc_idx, f"{name}.w12.esc_val": w.esc_val}
            clash = set(keys) & set(tensors)
            if clash:
                raise W12FormatError(f"{f.name} already holds a tensor named {clash.pop()!r}")
            stored.update(keys)
            renames[name] = list(keys)
            entries[name] = _entry(f.name, "w12", t, sum(v.numel() * v.element_size() for v in keys.values()),
                                   w.num_escapes)
        save_safetensors({k: v.contiguous() for k, v in stored.items()}, out / f.name, metadata=meta)
    hashed: dict[str, dict] = {}
    for p in sorted(src.iterdir()):
        if p.suffix == ".safetensors":
            continue
        if p.name.endswith(".safetensors.index.json"):
            _write_index(p, out / p.name, renames, out)
            hashed[p.name] = _file_entry(out / p.name)
        elif p.is_dir():
            shutil.copytree(p, out / p.name)
            for root, _, names in os.walk(out / p.name):
                for n in sorted(names):
                    rel = (Path(root) / n).relative_to(out).as_posix()
                    hashed[rel] = _file_entry(src / rel)
        else:
            shutil.copy2(p, out / p.name)
            hashed[p.name] = _file_entry(p)
    manifest = {"format": FORMAT, "version": VERSION,
                "record": {"rows": RECORD_ROWS, "cols": RECORD_COLS, "bytes": RECORD_BYTES},
                "tensors": entries, "copied_tensors": copied, "files": dict(sorted(hashed.items())),
                "totals": _totals(list(entries.values()))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _copied_entry(file: str, t: torch.Tensor) -> dict:
    """Manifest entry of a tensor stored unchanged: its shard, dtype, shape and sha256."""
    return {"file": file, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": sha256_of(t)}


def _file_entry(path: Path) -> dict:
    """Manifest entry of a copied file: sha256 and size of ``path`` in bytes. Raises W12FormatError when unreadable."""
    try:
        return {"sha256": sha256_of_file(path), "bytes": path.stat().st_size}
    except OSError as e:
        raise W12FormatError(f"cannot read {path}: {e.strerror or e}") from None


def _write_index(src_index: Path, dst: Path, renames: dict[str, list[str]], out: Path) -> None:
    """Copy a shard index, mapping each converted name to its W12 keys and updating ``total_size``."""
    try:
        idx = json.loads(src_index.read_text())
        wm = idx["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise W12FormatError(f"{src_index.name} is not a safetensors index (no weight_map)") from None
    new = {}
    for name, file in wm.items():
        for k in renames.get(name, [name]):
            new[k] = file
    idx["weight_map"] = new
    if isinstance(idx.get("metadata"), dict) and "total_size" in idx["metadata"]:
        idx["metadata"]["total_size"] = sum(
            _header_size(out / fn) for fn in sorted(set(new.values())) if (out / fn).is_file())
    dst.write_text(json.dumps(idx, indent=2) + "\n")


def _header_size(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (file size minus header)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
    return path.stat().st_size - 8 - n


__all__ = ["pack_dir", "is_linear_weight", "MANIFEST"]

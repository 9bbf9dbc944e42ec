"""W12 checkpoint directories: pack, verify, load (§4.1).

:func:`pack_dir` converts the linear-layer weights of any safetensors checkpoint directory (one file, or
shards with a ``*.safetensors.index.json``; the engine need not support the model) and copies every other
file unchanged. A tensor is a *linear weight* when it is 2-D floating point, its name ends in ``.weight``,
and the name contains none of ``embed``, ``norm``, ``wte``, ``wpe`` (embeddings are gathered, not
multiplied). ``lm_head.weight`` counts as linear unless ``config.json`` says ``tie_word_embeddings: true``
(then it is an alias of the embedding and stays as it is). Rows are the tensor's first dimension.

Each bf16 linear weight ``NAME`` becomes four tensors in the same shard: ``NAME.w12.records`` (uint8),
``NAME.w12.base`` (uint8), ``NAME.w12.esc_idx`` (int32/int64), ``NAME.w12.esc_val`` (int16), see
:mod:`specpilot.w12.format`. A float16/float32 linear weight has no W12 form: it is stored unchanged under
``NAME`` and listed as ``raw`` (its own bits/weight, 16 or 32) in the manifest and in verify's output.

``w12.json`` (the manifest): ``{"format": "specpilot-w12", "version": 1, "record": {...}, "tensors":
{NAME: {"file", "encoding": "w12" | "raw", "dtype", "shape", "sha256", "bytes", "bits_per_weight",
"escapes", "escape_rate"}}, "totals": {...}}``; ``sha256`` is that of the source tensor's bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .format import (RECORD_BYTES, RECORD_COLS, RECORD_ROWS, W12FormatError, W12Tensor, decode, encode,
                     sha256_of)

MANIFEST = "w12.json"
FORMAT, VERSION = "specpilot-w12", 1
PARTS = ("records", "base", "esc_idx", "esc_val")
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
            empty / the same as ``src``.
    """
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise W12FormatError(f"source directory not found: {src}")
    if (src / MANIFEST).exists():
        raise W12FormatError(f"{src} is already a W12 directory ({MANIFEST} present)")
    if out.exists() and (out.resolve() == src.resolve() or any(out.iterdir())):
        raise W12FormatError(f"output directory {out} is not empty: choose a new or empty directory")
    files = _files(src)
    tied = False
    if (src / "config.json").is_file():
        try:
            tied = bool(json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False))
        except (json.JSONDecodeError, AttributeError):
            raise W12FormatError(f"{src / 'config.json'} is not a valid JSON object") from None
    out.mkdir(parents=True, exist_ok=True)
    entries, renames = {}, {}
    for f in files:
        tensors, meta = _read_file(f)
        stored = {}
        for name, t in tensors.items():
            if not is_linear_weight(name, t, tied):
                stored[name] = t
                continue
            if t.dtype != torch.bfloat16:
                stored[name] = t
                entries[name] = _entry(f.name, "raw", t, t.numel() * t.element_size(), 0)
                continue
            w = encode(t)
            keys = {f"{name}.w12.{p}": getattr(w, p) for p in PARTS}
            clash = set(keys) & set(tensors)
            if clash:
                raise W12FormatError(f"{f.name} already holds a tensor named {clash.pop()!r}")
            stored.update(keys)
            renames[name] = list(keys)
            entries[name] = _entry(f.name, "w12", t, w.nbytes, w.num_escapes)
        save_file({k: v.contiguous() for k, v in stored.items()}, str(out / f.name), metadata=meta)
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            continue
        if p.name.endswith(".safetensors.index.json"):
            _write_index(p, out / p.name, renames, out)
        elif p.is_dir():
            shutil.copytree(p, out / p.name)
        else:
            shutil.copy2(p, out / p.name)
    manifest = {"format": FORMAT, "version": VERSION,
                "record": {"rows": RECORD_ROWS, "cols": RECORD_COLS, "bytes": RECORD_BYTES},
                "tensors": entries, "totals": _totals(list(entries.values()))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


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


def read_manifest(d: str | Path) -> dict:
    """Parsed ``w12.json`` manifest (§4.1) of W12 directory ``d``. Raises W12FormatError when missing or invalid."""
    p = Path(d) / MANIFEST
    if not Path(d).is_dir():
        raise W12FormatError(f"directory not found: {d}")
    if not p.is_file():
        raise W12FormatError(f"no {MANIFEST} in {d}: not a W12 directory (make one with `specpilot w12 pack`)")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise W12FormatError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("tensors"), dict):
        raise W12FormatError(f"{p} is not a {FORMAT} manifest")
    if m.get("version") != VERSION:
        raise W12FormatError(f"{p} has format version {m.get('version')}, this SpecPilot reads version {VERSION}")
    return m


def _restore_entry(name: str, e: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The restored source tensor of manifest entry ``e`` (no hash check). Raises W12FormatError."""
    try:
        if e["encoding"] == "raw":
            return tensors[name]
        n, k = (int(x) for x in e["shape"])
        t = W12Tensor(*(tensors[f"{name}.w12.{p}"] for p in PARTS), shape=(n, k), sha256=e["sha256"])
    except KeyError as err:
        raise W12FormatError(f"{e.get('file')}: tensor {err.args[0]!r} listed in {MANIFEST} is missing") from None
    except (TypeError, ValueError):
        raise W12FormatError(f"{MANIFEST}: bad entry for {name!r}") from None
    t.validate()
    return decode(t, check=False)


def load_w12_state_dict(d: str | Path) -> dict[str, torch.Tensor]:
    """The decoded state dict of a W12 directory (§4.1: checked bit for bit at load), CPU tensors in their
    source dtypes, every converted tensor checked against the sha256 of its source.

    W12 tensors come back as bf16 under their source names; raw and unconverted tensors as stored.

    Raises:
        W12FormatError: missing/invalid manifest, unreadable file, missing tensor, or a restored tensor whose
            bytes differ from the sha256 of its source.
    """
    d = Path(d)
    m = read_manifest(d)
    state: dict[str, torch.Tensor] = {}
    for f in _files(d):
        tensors, _ = _read_file(f)
        listed = {n: e for n, e in m["tensors"].items() if e.get("file") == f.name}
        for name, e in listed.items():
            try:
                w = _restore_entry(name, e, tensors)
            except W12FormatError as err:
                raise W12FormatError(f"{f.name}: tensor {name!r}: {err}") from None
            if sha256_of(w) != e["sha256"]:
                raise W12FormatError(f"{f.name}: tensor {name!r} does not match its stored sha256 (corrupted)")
            state[name] = w
        own = {f"{n}.w12.{p}" for n in listed for p in PARTS}
        state.update({k: v for k, v in tensors.items() if k not in own and k not in listed})
    missing = set(m["tensors"]) - set(state)
    if missing:
        raise W12FormatError(f"tensor {sorted(missing)[0]!r} listed in {MANIFEST} is in no safetensors file of {d}")
    return state


def verify_dir(d: str | Path, source: str | Path | None = None) -> dict:
    """§4.1 verify: restore every listed tensor of W12 directory ``d``, compare it bit for bit with its stored sha256
    and, with ``source``, with the source checkpoint (every tensor, converted or not).

    Returns:
        ``{"bit_exact": bool, "bits_per_weight", "escape_rate", "weights", "bytes", "escapes", "tensors_w12",
        "tensors_raw", "source_checked": bool, "tensors": [{"name", "encoding", "dtype", "shape",
        "bits_per_weight", "escapes", "escape_rate", "bit_exact", "error"}]}``; bits/weight and escapes are
        recounted from the stored tensors, totals are over all listed tensors.
    Raises:
        W12FormatError: missing/invalid manifest, a file that cannot be read (truncated, bad header), or a
            ``source`` that is not a checkpoint directory.
    """
    d = Path(d)
    m = read_manifest(d)
    src_state: dict[str, torch.Tensor] | None = None
    if source is not None:
        if not Path(source).is_dir():
            raise W12FormatError(f"source directory not found: {source}")
        src_state = {}
        for f in _files(Path(source)):
            src_state.update(_read_file(f)[0])
    rows, seen, other_ok = [], set(), True
    for f in _files(d):
        tensors, _ = _read_file(f)
        listed = {n: e for n, e in m["tensors"].items() if e.get("file") == f.name}
        for name, e in listed.items():
            row, err, stored, escapes = _verify_entry(name, e, tensors, src_state)
            seen.add(name)
            n = int(torch.Size(e["shape"]).numel())
            rows.append({"name": name, "encoding": e["encoding"], "dtype": e["dtype"], "shape": e["shape"],
                         "bits_per_weight": 8 * stored / max(n, 1), "bytes": stored, "escapes": escapes,
                         "escape_rate": escapes / max(n, 1), "bit_exact": row, "error": err})
        if src_state is not None:
            own = {f"{n}.w12.{p}" for n in listed for p in PARTS}
            for k, v in tensors.items():
                if k not in own and k not in listed:
                    seen.add(k)
                    other_ok &= k in src_state and _same_bits(v, src_state[k])
    for name in set(m["tensors"]) - seen:
        e = m["tensors"][name]
        rows.append({"name": name, "encoding": e["encoding"], "dtype": e["dtype"], "shape": e["shape"],
                     "bits_per_weight": 0.0, "bytes": 0, "escapes": 0, "escape_rate": 0.0, "bit_exact": False,
                     "error": f"listed in {MANIFEST} but in no safetensors file"})
    if src_state is not None:
        other_ok &= not (set(src_state) - seen)
    tot = _totals([{"shape": r["shape"], "bytes": r["bytes"], "escapes": r["escapes"], "encoding": r["encoding"]}
                   for r in rows])
    return {"bit_exact": all(r["bit_exact"] for r in rows) and other_ok, **tot,
            "source_checked": src_state is not None, "unconverted_match_source": other_ok if src_state is not None else None,
            "tensors": rows}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and sha256_of(a) == sha256_of(b)


def _verify_entry(name, e, tensors, src_state) -> tuple[bool, str | None, int, int]:
    """``(bit_exact, error, stored_bytes, escapes)`` of one manifest entry."""
    parts = [name] if e.get("encoding") == "raw" else [f"{name}.w12.{p}" for p in PARTS]
    stored = sum(tensors[p].numel() * tensors[p].element_size() for p in parts if p in tensors)
    escapes = int(tensors[f"{name}.w12.esc_idx"].numel()) if f"{name}.w12.esc_idx" in tensors else 0
    try:
        w = _restore_entry(name, e, tensors)
    except W12FormatError as err:
        return False, str(err), stored, escapes
    if sha256_of(w) != e["sha256"]:
        return False, "sha256 mismatch", stored, escapes
    if src_state is not None:
        if name not in src_state:
            return False, "not in the source directory", stored, escapes
        if not _same_bits(w, src_state[name]):
            return False, "differs from the source", stored, escapes
    return True, None, stored, escapes


__all__ = ["pack_dir", "verify_dir", "load_w12_state_dict", "read_manifest", "is_linear_weight", "MANIFEST"]

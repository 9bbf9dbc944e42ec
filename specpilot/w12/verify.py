"""W12 checkpoint directories: read the manifest, verify bit for bit, load (§4.1).

The directory layout and manifest are described in :mod:`specpilot.w12.pack`, which writes them. Loading checks
every restored tensor against the sha256 of its source and every copied file against its recorded hash, so a
flipped byte anywhere in the directory is caught and named; manifests of format version 1 are still read.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from specpilot.w12.format import W12FormatError, W12Tensor, decode, sha256_of, sha256_of_file, unpack_bases
from specpilot.w12.pack import FORMAT, MANIFEST, PARTS, PARTS_V1, VERSION, _files, _read_file, _totals


def read_manifest(d: str | Path) -> dict:
    """Parsed ``w12.json`` manifest (§4.1) of W12 directory ``d``. Raises W12FormatError when missing or invalid."""
    p = Path(d) / MANIFEST
    if not Path(d).is_dir():
        raise W12FormatError(f"{d} " + ("is a file, not a W12 directory" if Path(d).exists() else "directory not found"))
    if not p.is_file():
        raise W12FormatError(f"no {MANIFEST} in {d}: not a W12 directory (make one with `specpilot w12 pack`)")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise W12FormatError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("tensors"), dict):
        raise W12FormatError(f"{p} is not a {FORMAT} manifest")
    if m.get("version") not in (1, VERSION):
        raise W12FormatError(f"{p} has format version {m.get('version')!r}, this SpecPilot reads versions 1 and "
                             f"{VERSION} (integers)")
    for name, e in m["tensors"].items():
        if not _entry_ok(e):
            raise W12FormatError(f"{p}: bad entry for {name!r} (want an object with encoding 'raw' or 'w12', a file, "
                                 f"a dtype, a sha256 and, for 'w12', dtype 'bfloat16' and a 2-D integer shape)")
    return m


def _entry_ok(e) -> bool:
    """Whether a manifest tensor entry has the fields restoring it reads, of the right types."""
    if not isinstance(e, dict) or e.get("encoding") not in ("raw", "w12") or not isinstance(e.get("sha256"), str):
        return False
    if not isinstance(e.get("file"), str) or not isinstance(e.get("dtype"), str):
        return False
    if e["encoding"] == "w12" and e["dtype"] != "bfloat16":  # W12 encodes bf16 weights only
        return False
    shape = e.get("shape")
    return e["encoding"] == "raw" or (isinstance(shape, list) and len(shape) == 2
                                      and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape))


def parts_of(manifest: dict) -> tuple[str, ...]:
    """The stored tensor suffixes of a W12 weight in a directory of ``manifest``'s format version."""
    return PARTS_V1 if manifest.get("version") == 1 else PARTS


def _restore_entry(name: str, e: dict, tensors: dict[str, torch.Tensor], parts=PARTS) -> torch.Tensor:
    """The restored source tensor of manifest entry ``e`` (no hash check); ``parts``: :func:`parts_of` the
    manifest. Raises W12FormatError."""
    try:
        if e["encoding"] == "raw":
            return tensors[name]
        n, k = (int(x) for x in e["shape"])
        rec, base, idx, val = (tensors[f"{name}.w12.{p}"] for p in parts)
        if parts == PARTS:  # format 2: the bases are packed
            base = unpack_bases(base, n)
        t = W12Tensor(rec, base, idx, val, shape=(n, k), sha256=e["sha256"])
    except KeyError as err:
        raise W12FormatError(f"{e.get('file')}: tensor {err.args[0]!r} listed in {MANIFEST} is missing") from None
    except (TypeError, ValueError):
        raise W12FormatError(f"{MANIFEST}: bad entry for {name!r}") from None
    t.validate()
    return decode(t, check=False)


LEGACY_FILES_NOTE = (f"copied files: this {MANIFEST} predates per-file hashes (repack with `specpilot w12 pack` "
                     "to record them)")
LEGACY_TENSORS_NOTE = (f"tensors copied unchanged (embeddings, norms, ...): this {MANIFEST} predates their hashes "
                       "(repack, or compare with --source)")


def check_files(d: str | Path, manifest: dict) -> tuple[list[dict], list[str]]:
    """Compare every file listed under ``files`` in ``manifest`` with the file of that path in W12 directory ``d``.

    Returns:
        ``(rows, not_checked)``: ``rows`` is ``[{"path", "ok", "error"}]`` in path order (``error`` None when the
        file's sha256 matches, else ``"missing"``, ``"unreadable (...)"`` or ``"sha256 mismatch ..."``);
        ``not_checked`` is a one-element list of explanation when the manifest has no ``files`` key (written by
        an older SpecPilot), else empty.
    Raises:
        W12FormatError: ``files`` is not a mapping of relative paths to ``{"sha256": ...}`` entries.
    """
    d = Path(d)
    files = manifest.get("files")
    if files is None:
        return [], [LEGACY_FILES_NOTE]
    if not isinstance(files, dict):
        raise W12FormatError(f"{MANIFEST}: 'files' is not a mapping")
    rows = []
    for rel, e in sorted(files.items()):
        parts = Path(rel).parts
        if not isinstance(e, dict) or Path(rel).is_absolute() or ".." in parts or not parts:
            raise W12FormatError(f"{MANIFEST}: bad entry for file {rel!r}")
        p = d / rel
        if not p.is_file():
            err = "missing"
        else:
            try:
                h = sha256_of_file(p)
            except OSError as ex:
                h, err = None, f"unreadable ({ex.strerror or ex})"
            if h is not None:
                err = None if h == e.get("sha256") else "sha256 mismatch (changed or corrupted since packing)"
        rows.append({"path": rel, "ok": err is None, "error": err})
    return rows, []


def _check_copied(name: str, t: torch.Tensor, copied: dict) -> str | None:
    """None when tensor ``name`` matches its ``copied_tensors`` entry (dtype, shape, sha256), else the reason."""
    e = copied.get(name)
    if e is None:
        return f"not listed in {MANIFEST} (added after packing?)"
    if e.get("dtype") != str(t.dtype).removeprefix("torch.") or list(t.shape) != list(e.get("shape", ())):
        return f"dtype/shape {str(t.dtype).removeprefix('torch.')} {list(t.shape)} differ from {MANIFEST}'s"
    if sha256_of(t) != e.get("sha256"):
        return "sha256 mismatch (corrupted)"
    return None


def load_w12_state_dict(d: str | Path) -> dict[str, torch.Tensor]:
    """The decoded state dict of a W12 directory (§4.1: checked bit for bit at load), CPU tensors in their
    source dtypes, every converted tensor checked against the sha256 of its source, every copied tensor and
    copied file against the sha256 the manifest records for it.

    W12 tensors come back as bf16 under their source names; raw and unconverted tensors as stored. A manifest
    of an older SpecPilot without ``files`` / ``copied_tensors`` loads with a :class:`UserWarning` saying what was
    not checked.

    Raises:
        W12FormatError: missing/invalid manifest, unreadable file, missing tensor, a restored tensor whose bytes
            differ from the sha256 of its source, or a copied tensor / file that is missing, not listed or
            differs from its recorded sha256 (the message names the file and tensor).
    """
    d = Path(d)
    m = read_manifest(d)
    file_rows, notes = check_files(d, m)
    bad = next((r for r in file_rows if not r["ok"]), None)
    if bad is not None:
        raise W12FormatError(f"copied file {bad['path']}: {bad['error']}")
    copied = m.get("copied_tensors")
    if copied is not None and not isinstance(copied, dict):
        raise W12FormatError(f"{MANIFEST}: 'copied_tensors' is not a mapping")
    if copied is None:
        notes.append(LEGACY_TENSORS_NOTE)
    if notes:
        warnings.warn(f"W12 checkpoint {d}: not checked: " + "; ".join(notes), stacklevel=2)
    state: dict[str, torch.Tensor] = {}
    for f in _files(d):
        tensors, _ = _read_file(f)
        listed = {n: e for n, e in m["tensors"].items() if e.get("file") == f.name}
        for name, e in listed.items():
            try:
                w = _restore_entry(name, e, tensors, parts_of(m))
            except W12FormatError as err:
                raise W12FormatError(f"{f.name}: tensor {name!r}: {err}") from None
            if sha256_of(w) != e["sha256"]:
                raise W12FormatError(f"{f.name}: tensor {name!r} does not match its stored sha256 (corrupted)")
            state[name] = w
        own = {f"{n}.w12.{p}" for n in listed for p in parts_of(m)}
        for k, v in tensors.items():
            if k in own or k in listed:
                continue
            err = _check_copied(k, v, copied) if copied is not None else None
            if err is not None:
                raise W12FormatError(f"{f.name}: tensor {k!r}: {err}")
            state[k] = v
    missing = set(m["tensors"]) - set(state)
    if missing:
        raise W12FormatError(f"tensor {sorted(missing)[0]!r} listed in {MANIFEST} is in no safetensors file of {d}")
    missing = set(copied or ()) - set(state)
    if missing:
        raise W12FormatError(f"tensor {sorted(missing)[0]!r} listed in {MANIFEST} is in no safetensors file of {d}")
    return state


def verify_dir(d: str | Path, source: str | Path | None = None) -> dict:
    """§4.1 verify: restore every listed tensor of W12 directory ``d``, compare it bit for bit with its stored sha256
    and, with ``source``, with the source checkpoint (every tensor, converted or not); compare every copied
    tensor and copied file with the sha256 the manifest records for it.

    Returns:
        ``{"bit_exact": bool, "bits_per_weight", "escape_rate", "weights", "bytes", "escapes", "tensors_w12",
        "tensors_raw", "source_checked": bool, "unconverted_match_source", "tensors": [{"name", "encoding",
        "dtype", "shape", "bits_per_weight", "escapes", "escape_rate", "bit_exact", "error"}], "copied_tensors":
        [{"name", "file", "bit_exact", "error"}], "files": [{"path", "ok", "error"}], "source_mismatches":
        [{"name", "reason"}] (with ``source``; in file order), "not_checked": [str] (what an older manifest
        cannot check), "problems": [str] (one line per failure, naming the file or tensor)}``; bits/weight and
        escapes are recounted from the stored tensors, totals are over the converted/raw tensors.
        ``bit_exact`` is True only when every tensor and file checks out.
    Raises:
        W12FormatError: missing/invalid manifest, a file that cannot be read (truncated, bad header), or a
            ``source`` that is not a checkpoint directory.
    """
    d = Path(d)
    m = read_manifest(d)
    src_state: dict[str, torch.Tensor] | None = None
    if source is not None:
        if not Path(source).is_dir():
            raise W12FormatError(f"source {source} " + ("is a file, not a directory" if Path(source).exists()
                                                         else "not found"))
        src_state = {}
        for f in _files(Path(source)):
            src_state.update(_read_file(f)[0])
    file_rows, not_checked = check_files(d, m)
    copied = m.get("copied_tensors")
    if copied is not None and not isinstance(copied, dict):
        raise W12FormatError(f"{MANIFEST}: 'copied_tensors' is not a mapping")
    if copied is None:
        not_checked.append(LEGACY_TENSORS_NOTE)
    rows, copied_rows, src_bad, seen = [], [], [], set()
    for f in _files(d):
        tensors, _ = _read_file(f)
        listed = {n: e for n, e in m["tensors"].items() if e.get("file") == f.name}
        for name, e in listed.items():
            row, err, stored, escapes = _verify_entry(name, e, tensors, src_state, parts_of(m))
            seen.add(name)
            if err in ("not in the source directory", "differs from the source"):
                src_bad.append({"name": name, "reason": err})
            n = int(torch.Size(e["shape"]).numel())
            rows.append({"name": name, "encoding": e["encoding"], "dtype": e["dtype"], "shape": e["shape"],
                         "bits_per_weight": 8 * stored / max(n, 1), "bytes": stored, "escapes": escapes,
                         "escape_rate": escapes / max(n, 1), "bit_exact": row, "error": err})
        own = {f"{n}.w12.{p}" for n in listed for p in parts_of(m)}
        for k, v in tensors.items():
            if k in own or k in listed:
                continue
            seen.add(k)
            if copied is not None:
                err = _check_copied(k, v, copied)
                copied_rows.append({"name": k, "file": f.name, "bit_exact": err is None, "error": err})
            if src_state is not None:
                if k not in src_state:
                    src_bad.append({"name": k, "reason": "not in the source directory"})
                elif not _same_bits(v, src_state[k]):
                    src_bad.append({"name": k, "reason": "differs from the source"})
    for name in sorted(set(m["tensors"]) - seen):
        e = m["tensors"][name]
        rows.append({"name": name, "encoding": e["encoding"], "dtype": e["dtype"], "shape": e["shape"],
                     "bits_per_weight": 0.0, "bytes": 0, "escapes": 0, "escape_rate": 0.0, "bit_exact": False,
                     "error": f"listed in {MANIFEST} but in no safetensors file"})
    for name in sorted(set(copied or ()) - seen):
        copied_rows.append({"name": name, "file": copied[name].get("file"), "bit_exact": False,
                            "error": f"listed in {MANIFEST} but in no safetensors file"})
    if src_state is not None:
        src_bad += [{"name": k, "reason": "in the source but not in the W12 directory"}
                    for k in sorted(set(src_state) - seen)]
    tot = _totals([{"shape": r["shape"], "bytes": r["bytes"], "escapes": r["escapes"], "encoding": r["encoding"]}
                   for r in rows])
    problems = ([f"tensor {r['name']}: {r['error']}" for r in rows if not r["bit_exact"]]
                + [f"copied tensor {r['name']} ({r['file']}): {r['error']}" for r in copied_rows if not r["bit_exact"]]
                + [f"copied file {r['path']}: {r['error']}" for r in file_rows if not r["ok"]])
    if src_bad:
        problems.append(f"{len(src_bad)} tensor(s) differ from --source {source}, first: "
                        + ", ".join(f"{b['name']} ({b['reason']})" for b in src_bad[:3]))
    other_ok = not any(b["name"] not in m["tensors"] for b in src_bad)
    return {"bit_exact": not problems, **tot,
            "source_checked": src_state is not None,
            "unconverted_match_source": other_ok if src_state is not None else None,
            "tensors": rows, "copied_tensors": copied_rows, "files": file_rows,
            "source_mismatches": src_bad if src_state is not None else None,
            "not_checked": not_checked, "problems": problems}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and sha256_of(a) == sha256_of(b)


def _verify_entry(name, e, tensors, src_state, parts=PARTS) -> tuple[bool, str | None, int, int]:
    """``(bit_exact, error, stored_bytes, escapes)`` of one manifest entry (``parts``: :func:`parts_of`)."""
    keys = [name] if e.get("encoding") == "raw" else [f"{name}.w12.{p}" for p in parts]
    stored = sum(tensors[p].numel() * tensors[p].element_size() for p in keys if p in tensors)
    escapes = int(tensors[f"{name}.w12.esc_idx"].numel()) if f"{name}.w12.esc_idx" in tensors else 0
    try:
        w = _restore_entry(name, e, tensors, parts)
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


__all__ = ["verify_dir", "load_w12_state_dict", "read_manifest", "check_files"]

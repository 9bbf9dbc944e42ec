"""Memory of verified optimizations: one directory per entry (paper §3.5).

Layout of ``<root>/<id>/``:

- ``entry.json``: the metadata — id, title, mechanism, ``requires`` (entries applied first, in order),
  ``variants``, ``options``, ``contract``, ``evidence`` (paired-run and token-forcing figures, deployment,
  date), ``limits``, ``not_verified``, ``reused_from``, ``kind`` and the recorded ``base`` / ``system``;
- the delta, by ``kind``: ``delta.json``, a :class:`SystemConfig` delta (``base`` is the stock config,
  ``system`` the approved config), or ``delta.patch``, a code patch (``git diff``) against stock with the
  required entries applied (``base`` is ``{"commit": stock commit}``, ``system`` is ``{"tree": git tree
  id of the approved code}``).

The **reproduction check** (:meth:`Memory.reproduce`) rebuilds the approved system from stock and the
entry's chain of deltas, requirements first, and compares: configs by seal; code by applying the chain's
patches to the stock commit in a scratch git index and comparing tree ids (:mod:`.patches`) — or says
*not checkable* when the stock commit is not in the repository at hand. An entry that does not reproduce
does not survive. A config chain skips code entries and a code chain skips config entries (each kind
changes only its own half of a system). Entries reused in a new deployment name their origin in
``reused_from`` and are re-measured, not counted as new discoveries.

Entries written before this layout (the config delta inline in ``entry.json``) are read as config entries.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.pilot.patches import rebuild_tree

DEFAULT_CONTRACT = "output == AR in float32; token forcing passes"
DELTA_FILES = {"config": "delta.json", "patch": "delta.patch"}


class MemoryEntryError(SpecPilotError):
    """A memory entry is missing, corrupted, requires a missing entry, or its requirements form a cycle."""


#: an entry id: its directory's plain name (no path separators, no leading dot: never ``..`` or ``a/../b``)
ENTRY_ID = r"^[a-z0-9][a-z0-9_.-]*$"


class Evidence(BaseModel):
    """Summary of the evidence an entry was approved on (§3.3, §3.4).

    Attributes:
        gain / lower_bound: paired-run gain over the incumbent and its 95% lower bound (ratios).
        bar: the bar ``lower_bound - 1`` had to exceed (fraction); sigma: stock noise σ (fraction).
        forcing: token-forcing figures (mismatch_rate, events, delta, ...).
        deployment: target, drafter, device, dtype, batch, ...; date: ISO date of the approval.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    gain: float
    lower_bound: float
    bar: float
    sigma: float
    forcing: dict = Field(default_factory=dict)
    deployment: dict = Field(default_factory=dict)
    date: str = ""


class Entry(BaseModel):
    """One approved mechanism (§3.5).

    Attributes:
        id: directory name (lowercase letters, digits, ``._-``).
        title / mechanism: human title and the registry name of the mechanism.
        requires: ids of the entries applied before this one, in order.
        kind: ``config`` (``delta`` is a ``SystemConfig`` delta dict) or ``patch`` (``delta`` is the text
            of a git patch).
        delta: the change relative to ``base`` + requirements.
        variants / options: variant registry and tunable options of the mechanism.
        contract: what it must preserve. evidence: :class:`Evidence`.
        base / system: config kind: the stock and the approved config (``model_dump()`` dicts); patch
            kind: ``{"commit": stock commit}`` and ``{"tree": tree id of the approved code}``.
        limits / not_verified: known limits; what was not verified.
        status: always ``approved``. reused_from: origin entry/deployment when reused.
    Raises:
        pydantic.ValidationError: a field of the wrong form (e.g. a patch entry without ``base.commit``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=ENTRY_ID, max_length=100)
    title: str
    mechanism: str
    requires: list[str] = Field(default_factory=list)
    kind: Literal["config", "patch"] = "config"
    delta: dict | str
    variants: dict = Field(default_factory=dict)
    options: dict = Field(default_factory=dict)
    contract: str = DEFAULT_CONTRACT
    evidence: Evidence
    base: dict
    system: dict
    limits: list[str] = Field(default_factory=list)
    not_verified: list[str] = Field(default_factory=list)
    status: Literal["approved"] = "approved"
    reused_from: str | None = None

    @model_validator(mode="after")
    def _kind_fits(self) -> "Entry":
        if self.kind == "config" and not isinstance(self.delta, dict):
            raise ValueError("a config entry's delta is a dict of SystemConfig fields")
        if self.kind == "patch":
            if not isinstance(self.delta, str) or not self.delta.strip():
                raise ValueError("a patch entry's delta is the non-empty text of a git patch")
            if not isinstance(self.base.get("commit"), str) or not isinstance(self.system.get("tree"), str):
                raise ValueError("a patch entry records base.commit (stock) and system.tree (approved code)")
        return self


@dataclass(frozen=True)
class Reproduction:
    """Result of :meth:`Memory.reproduce` for one entry.

    ``status``: ``reproduced``; ``differs`` (rebuilt != recorded); ``does not apply`` (a patch of the
    chain fails); ``not checkable`` (code entry without the stock commit at hand); ``broken`` (missing or
    corrupted entry or requirement, cycle, invalid delta). ``detail`` says which and why, in one line.
    """

    id: str
    kind: str
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True iff the entry reproduced its recorded system exactly."""
        return self.status == "reproduced"

    @property
    def failed(self) -> bool:
        """True unless reproduced or honestly not checkable."""
        return self.status not in ("reproduced", "not checkable")


@dataclass(frozen=True)
class MemoryCheck:
    """Result of :meth:`Memory.check_all`: per-entry reproduction, whether stock + all entries
    reproduces the sealed system, and ``ok`` = all of them."""

    entries: dict[str, bool]
    sealed: bool
    ok: bool


def _why(err: Exception) -> str:
    """One line naming what is wrong in a delta: pydantic's field errors (``nodes: Input should be greater
    than or equal to 1``), else the exception's first line."""
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'delta'}: {e['msg']}" for e in err.errors())
    return str(err).splitlines()[0]


def default_repo() -> Path:
    """The git checkout holding this package (where stock commits of code entries are looked up)."""
    return Path(__file__).resolve().parents[2]


class Memory:
    """Entries on disk under ``root`` (created on first :meth:`add`).

    Args:
        root: memory directory; each entry is the directory ``root/<id>/``.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def add(self, entry: Entry, overwrite: bool = False) -> Path:
        """Write ``entry`` to ``root/<id>/`` (``entry.json`` + its delta file); returns the directory.

        Raises:
            MemoryEntryError: the id exists and ``overwrite`` is False, or the entry requires itself.
        """
        if entry.id in entry.requires:
            raise MemoryEntryError(f"entry {entry.id!r} requires itself")
        d = self.root / entry.id
        if (d / "entry.json").exists() and not overwrite:
            raise MemoryEntryError(f"memory entry {entry.id!r} already exists in {self.root}")
        d.mkdir(parents=True, exist_ok=True)
        for kind, name in DELTA_FILES.items():
            if kind != entry.kind and (d / name).exists():
                (d / name).unlink()
        delta = entry.delta if entry.kind == "patch" else json.dumps(entry.delta, indent=2, sort_keys=True) + "\n"
        (d / DELTA_FILES[entry.kind]).write_text(delta)
        meta = entry.model_dump(mode="json", exclude={"delta"})
        tmp = d / "entry.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, d / "entry.json")
        return d

    def ids(self) -> list[str]:
        """Sorted ids of the entries on disk: sub-directories holding ``entry.json`` or a delta file (one with
        a delta but no ``entry.json`` is listed, and :meth:`get` reports it corrupted)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if any((p / f).is_file() for f in ("entry.json", *DELTA_FILES.values())))

    def list(self) -> list[Entry]:
        """All entries, sorted by id. Raises MemoryEntryError on a corrupted entry."""
        return [self.get(i) for i in self.ids()]

    def get(self, entry_id: str) -> Entry:
        """The entry ``entry_id`` with its delta. Raises MemoryEntryError if missing or corrupted, or if
        ``entry_id`` is not a plain entry id (:data:`ENTRY_ID`: a path such as ``../x`` never leaves ``root``)."""
        if not re.fullmatch(ENTRY_ID, entry_id) or len(entry_id) > 100:
            raise MemoryEntryError(f"{entry_id!r} is not a memory entry id (lowercase letters, digits and ._-, "
                                   "starting with a letter or digit: the entry's directory name)")
        d = self.root / entry_id
        f = d / "entry.json"
        if not f.is_file():
            if any((d / name).is_file() for name in DELTA_FILES.values()):
                raise MemoryEntryError(f"memory entry {d} is corrupted: its entry.json is missing")
            raise MemoryEntryError(f"no memory entry {entry_id!r} in {self.root}")
        try:
            meta = json.loads(f.read_text())
            if not isinstance(meta, dict):
                raise ValueError("entry.json is not a JSON object")
            if "delta" not in meta:  # the current layout: the delta in its own file
                kind = meta.get("kind", "config")
                df = d / DELTA_FILES.get(kind, "delta.json")
                if not df.is_file():
                    raise ValueError(f"its delta file {df.name} is missing")
                meta["delta"] = df.read_text() if kind == "patch" else json.loads(df.read_text())
            entry = Entry.model_validate(meta)
            if entry.id != d.name:  # requires / --memory / show find entries by directory name
                raise ValueError(f"its id {entry.id!r} differs from its directory name {d.name!r}")
            return entry
        except (ValidationError, ValueError) as e:
            raise MemoryEntryError(f"memory entry {d} is corrupted: {str(e).splitlines()[0]}") from None

    def order(self, ids: list[str]) -> list[Entry]:
        """Entries ``ids`` with all their requirements, each once, requirements first (depth-first in
        listed order: a topological order).

        Raises:
            MemoryEntryError: a missing entry or requirement, or a requirement cycle.
        """
        done: dict[str, Entry] = {}
        path: list[str] = []

        def visit(i: str) -> None:
            if i in done:
                return
            if i in path:
                raise MemoryEntryError("requirement cycle: " + " -> ".join(path[path.index(i) :] + [i]))
            try:
                e = self.get(i)
            except MemoryEntryError:
                if path and not (self.root / i / "entry.json").is_file():
                    raise MemoryEntryError(f"entry {path[-1]!r} requires missing entry {i!r}") from None
                raise
            path.append(i)
            for r in e.requires:
                visit(r)
            path.pop()
            done[i] = e

        for i in ids:
            visit(i)
        return list(done.values())

    def apply(self, stock: SystemConfig, ids: list[str]) -> SystemConfig:
        """``stock`` with the config deltas of entries ``ids`` and their requirements applied,
        requirements first (§3.5); code entries in the chain do not change the config.

        Raises:
            MemoryEntryError: missing entry/requirement, cycle, or a delta invalid for this config.
        """
        cfg = stock
        for e in self.order(list(ids)):
            if e.kind != "config":
                continue
            try:
                cfg = cfg.apply(e.delta)
            except (ValidationError, TypeError) as err:
                raise MemoryEntryError(f"entry {e.id!r}: delta does not apply: {_why(err)}") from None
        return cfg

    def reproduce(self, entry_id: str, repo: str | Path | None = None) -> Reproduction:
        """Reproduction check of one entry (§3.5): rebuild from its recorded stock + requirements + delta
        and compare with the recorded approved system. Never raises: failures are statuses.

        Args:
            entry_id: the entry. repo: git repository for code entries (default :func:`default_repo`).
        """
        try:
            e = self.get(entry_id)
            chain = self.order([entry_id])
        except MemoryEntryError as err:
            return Reproduction(entry_id, "?", "broken", str(err))
        if e.kind == "config":
            try:
                rebuilt = self.apply(SystemConfig(**e.base), [entry_id])
                want = SystemConfig(**e.system)
            except (MemoryEntryError, ValidationError, TypeError) as err:
                return Reproduction(e.id, e.kind, "broken", str(err).splitlines()[0])
            if rebuilt.seal() == want.seal():
                return Reproduction(e.id, e.kind, "reproduced", f"seal {want.seal()[:12]}")
            return Reproduction(e.id, e.kind, "differs", f"rebuilt config differs in {sorted(rebuilt.delta(want))}")
        patches = [x for x in chain if x.kind == "patch"]
        other = next((x for x in patches if x.base.get("commit") != e.base["commit"]), None)
        if other is not None:
            return Reproduction(e.id, e.kind, "broken", f"requirement {other.id!r} was recorded against stock "
                                f"{other.base.get('commit', '?')[:12]}, this entry against {e.base['commit'][:12]}")
        res = rebuild_tree(repo or default_repo(), e.base["commit"], [(x.id, x.delta) for x in patches])
        if res.status != "built":
            return Reproduction(e.id, e.kind, res.status, res.detail)
        if res.tree == e.system["tree"]:
            return Reproduction(e.id, e.kind, "reproduced", f"tree {res.tree[:12]}")
        return Reproduction(e.id, e.kind, "differs", f"rebuilt tree {res.tree[:12]} != recorded {e.system['tree'][:12]}")

    def check(self, entry_id: str, expected: SystemConfig | None = None) -> bool:
        """True iff the entry reproduces: its recorded system (:meth:`reproduce`), or, for a config entry,
        the given ``expected`` config (same seal). False also when broken."""
        if expected is None:
            return self.reproduce(entry_id).ok
        try:
            e = self.get(entry_id)
            return e.kind == "config" and self.apply(SystemConfig(**e.base), [entry_id]).seal() == expected.seal()
        except (MemoryEntryError, ValidationError, TypeError):
            return False

    def check_all(self, stock: SystemConfig, sealed: SystemConfig, ids: list[str] | None = None) -> MemoryCheck:
        """Check entries ``ids`` (default: all on disk), each against its recorded system, and that
        ``stock`` + those entries (requirements first) reproduces the ``sealed`` final system.

        Returns:
            :class:`MemoryCheck`.
        """
        ids = self.ids() if ids is None else list(ids)
        per = {i: self.check(i) for i in ids}
        try:
            whole = self.apply(stock, ids).seal() == sealed.seal()
        except MemoryEntryError:
            whole = False
        return MemoryCheck(per, whole, whole and all(per.values()))

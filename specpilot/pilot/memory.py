"""Memory of verified optimizations: one directory per entry (paper §3.5).

An entry is ``<root>/<id>/entry.json``. Its ``delta`` is a :class:`SystemConfig` delta relative to
stock with the entries it ``requires`` applied first (in their listed order). It records the stock it
was approved against (``base``) and the approved system (``system``), so the **reproduction check**
is self-contained: base + requirements + delta must reproduce ``system`` exactly (same seal). An entry
that fails it does not survive. Entries reused in a new deployment are re-tuned and re-measured
(``reused_from`` names the origin) and are not counted as new discoveries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import SystemConfig
from ..errors import SpecPilotError

DEFAULT_CONTRACT = "output == AR in float32; token forcing passes"


class MemoryEntryError(SpecPilotError):
    """A memory entry is missing, corrupted, requires a missing entry, or its requirements form a cycle."""


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
        delta: ``SystemConfig`` delta relative to ``base`` + requirements.
        variants / options: variant registry and tunable options of the mechanism.
        contract: what it must preserve. evidence: :class:`Evidence`.
        base / system: the stock config and the approved config (``model_dump()`` dicts).
        limits / not_verified: known limits; what was not verified.
        status: always ``approved``. reused_from: origin entry/deployment when reused.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", max_length=100)
    title: str
    mechanism: str
    requires: list[str] = Field(default_factory=list)
    delta: dict
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


@dataclass(frozen=True)
class MemoryCheck:
    """Result of :meth:`Memory.check_all`: per-entry reproduction, whether stock + all entries
    reproduces the sealed system, and ``ok`` = all of them."""

    entries: dict[str, bool]
    sealed: bool
    ok: bool


class Memory:
    """Entries on disk under ``root`` (created on first :meth:`add`).

    Args:
        root: memory directory; each entry lives in ``root/<id>/entry.json``.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def add(self, entry: Entry, overwrite: bool = False) -> Path:
        """Write ``entry`` to ``root/<id>/entry.json`` (atomically) and return that path.

        Raises:
            MemoryEntryError: the id exists and ``overwrite`` is False, or the entry requires itself.
        """
        if entry.id in entry.requires:
            raise MemoryEntryError(f"entry {entry.id!r} requires itself")
        d = self.root / entry.id
        if (d / "entry.json").exists() and not overwrite:
            raise MemoryEntryError(f"memory entry {entry.id!r} already exists in {self.root}")
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "entry.json.tmp"
        tmp.write_text(json.dumps(entry.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, d / "entry.json")
        return d / "entry.json"

    def ids(self) -> list[str]:
        """Sorted ids of the entries on disk."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "entry.json").is_file())

    def list(self) -> list[Entry]:
        """All entries, sorted by id. Raises MemoryEntryError on a corrupted entry."""
        return [self.get(i) for i in self.ids()]

    def get(self, entry_id: str) -> Entry:
        """The entry ``entry_id``. Raises MemoryEntryError if missing or corrupted."""
        f = self.root / entry_id / "entry.json"
        if not f.is_file():
            raise MemoryEntryError(f"no memory entry {entry_id!r} in {self.root}")
        try:
            return Entry.model_validate_json(f.read_text())
        except (ValidationError, ValueError) as e:
            raise MemoryEntryError(f"memory entry {f} is corrupted: {str(e).splitlines()[0]}") from None

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
                if path:
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
        """``stock`` with entries ``ids`` and their requirements applied, requirements first (§3.5).

        Raises:
            MemoryEntryError: missing entry/requirement, cycle, or a delta invalid for this config.
        """
        cfg = stock
        for e in self.order(list(ids)):
            try:
                cfg = cfg.apply(e.delta)
            except (ValidationError, TypeError) as err:
                raise MemoryEntryError(f"entry {e.id!r}: delta does not apply: {str(err).splitlines()[0]}") from None
        return cfg

    def check(self, entry_id: str, expected: SystemConfig | None = None) -> bool:
        """Reproduction check (§3.5): the entry's ``base`` + requirements + delta == ``expected``.

        Args:
            entry_id: the entry to check.
            expected: the approved system (default: the ``system`` recorded in the entry).
        Returns:
            True iff the seals (SHA-256 of the canonical config) are equal; False also when the entry's
            requirements are missing or cyclic, or its configs are invalid.
        """
        try:
            e = self.get(entry_id)
            want = expected if expected is not None else SystemConfig(**e.system)
            return self.apply(SystemConfig(**e.base), [entry_id]).seal() == want.seal()
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

"""What ``specpilot serve --system`` serves: a system sealed by ``specpilot pilot`` (its ``system.json``), or the
systems ``specpilot pilot --batch`` sealed per batch size (its output directory, one ``system_n<N>.json`` each),
served together as a :class:`~specpilot.engine.load_plan.LoadPlan` so that each step runs the system sealed for the
load nearest its own (§4.4: the system that wins at one request loses at sixteen).

Every file's config must match its ``seal`` (edited after sealing: refused, unless ``allow_edited``). Errors are one
line (:class:`~specpilot.errors.SpecPilotError`), raised before anything loads.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specpilot.config import SystemConfig
from specpilot.engine.load_plan import LoadPlan
from specpilot.errors import SpecPilotError, validation_message

#: A batched pilot's per-size system files.
SIZED = re.compile(r"system_n(\d+)\.json")


@dataclass(frozen=True)
class Sealed:
    """A sealed system ready to serve: ``config`` (one system, or a plan of one per batch size), the target and
    draft-model directories (``ddir`` None: none), the device, the engine's slots and how the files were found
    (``source``, for the start line)."""

    config: SystemConfig | LoadPlan
    tdir: Path
    ddir: Optional[Path]
    device: str
    max_num_seqs: int
    source: str


def read_system(path: Path) -> tuple[dict, dict, Optional[int], object]:
    """``(config, deployment, batch_size, seal)`` of a sealed ``system.json`` written by ``specpilot pilot``.

    ``batch_size``: the number of requests at once the system was sealed for (``specpilot pilot --batch`` writes it
    into each ``system_n{n}.json``); None where the file does not say (the single-request pilot's). ``seal``: the
    file's ``seal`` as written (None where it has none; checked by :func:`check_seal`).

    Raises:
        SpecPilotError: the file is missing, not JSON, has no ``config`` object, or a ``batch_size`` that is not a
            positive integer (one line).
    """
    from specpilot.text import read_text

    try:
        sysd = json.loads(read_text(path, f"--system {path}"))
    except ValueError as e:
        raise SpecPilotError(f"--system {path} is not JSON: {e}") from None
    if not isinstance(sysd, dict) or not isinstance(sysd.get("config"), dict):
        raise SpecPilotError(f"--system {path} is not a sealed system (no 'config' object; `specpilot pilot` writes "
                             "one as <out>/system.json)")
    dep = sysd.get("deployment") if isinstance(sysd.get("deployment"), dict) else {}
    size = sysd.get("batch_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise SpecPilotError(f"--system {path}: 'batch_size' must be a positive integer, got {size!r}")
    return sysd["config"], dep, size, sysd.get("seal")


def check_seal(path: Path, cfg: SystemConfig, seal, allow_edited: bool) -> None:
    """Check that the ``seal`` of the system file ``path`` is the seal of its config ``cfg`` (the SHA-256 of its
    canonical JSON, :meth:`SystemConfig.seal`), so that a config edited after `specpilot pilot` judged and sealed it
    (another ``nodes``, say) is not served as if it were the sealed system. With ``allow_edited`` a missing or wrong
    seal is a warning on stderr instead.

    Raises:
        SpecPilotError: the seal is missing or does not match, and not ``allow_edited`` (one line naming the file).
    """
    if seal == cfg.seal():
        return
    what = ("has no 'seal'" if seal is None else
            f"has a config that does not match its seal ({str(seal)[:12]}, the config's is {cfg.seal()[:12]})")
    if not allow_edited:
        raise SpecPilotError(f"--system {path} {what}: it was edited after `specpilot pilot` sealed it, or not "
                             "sealed by it; serve the file as sealed, or pass --allow-edited-system to serve it as it "
                             "is")
    print(f"specpilot serve: warning: --system {path} {what}; serving its config as it is ({cfg.label()}), which "
          "is not the system the pilot judged (--allow-edited-system)", file=sys.stderr)


def load_sealed(system: Path, target: Optional[Path], allow_edited: bool, max_num_seqs: Optional[int],
                device: Optional[str]) -> Sealed:
    """Read ``system`` (a ``system.json`` file, or a ``pilot --batch`` output directory) for ``serve``.

    ``target`` replaces the recorded target path (the same model elsewhere); ``max_num_seqs`` None: the sealed batch
    size (a plan: its largest; a file naming none: 16); ``device`` None: the recorded one (else ``cpu``).

    Raises:
        SpecPilotError: unreadable or edited files, a config that is not a SystemConfig, a TLV system (single
            requests only), no target recorded and none given, a directory with no system file, per-size files that
            name different targets, devices or draft models, systems that cannot share an engine (one line each).
    """
    files = _sized_files(system) if system.is_dir() else [(None, system)]
    read = []
    for n, f in files:
        cfg_d, dep, size, seal = read_system(f)
        try:
            cfg = SystemConfig(**cfg_d)
        except (TypeError, ValueError) as e:
            raise SpecPilotError(f"--system {f}: its config is not a SystemConfig: "
                                 f"{validation_message(e, flags=False)}") from None
        check_seal(f, cfg, seal, allow_edited)
        if cfg.tlv:  # the pilot seals for one request at a time (batch 1); the server batches
            raise SpecPilotError(f"--system {f} uses tlv, which runs single requests only (`specpilot generate` "
                                 "runs it); the server batches: serve it with \"tlv\": false in its config (and "
                                 "--allow-edited-system), or seal a system for serving")
        if n is not None and size is not None and size != n:  # a pilot names each file by the size it sealed
            raise SpecPilotError(f"--system {f} says batch_size {size} but is named for {n}: a `pilot --batch` "
                                 "directory holds system_n<N>.json sealed at N")
        read.append((size or n, f, cfg, dep))
    if target is None and any(not r[3].get("target") for r in read):
        bare = next(r[1] for r in read if not r[3].get("target"))
        raise SpecPilotError(f"--system {bare} names no target (its 'deployment' has no 'target'): give one with "
                             "--target DIR")
    for key in ("target", "device"):
        if len({r[3].get(key) for r in read}) > 1:
            raise SpecPilotError(f"--system {system}: its files name different {key}s: "
                                 + ", ".join(f"{r[1].name}: {r[3].get(key)}" for r in read))
    dep = read[0][3]
    from specpilot.zoo import resolve_recorded

    # --target: the same model elsewhere (another machine, a moved directory); else the recorded path, a bundled
    # model recorded under another install being this one's
    tdir = target if target is not None else resolve_recorded(dep["target"])
    src = f"--target; {system} names {dep.get('target')}" if target is not None else f"from {system}"
    cfgs, ddirs = zip(*(_drafter_dir(cfg, d) for _, _, cfg, d in read))
    ddirs = sorted({str(d) for d in ddirs if d is not None})
    if len(ddirs) > 1:  # the deployment loads one drafter checkpoint
        raise SpecPilotError(f"--system {system}: its systems read {len(ddirs)} drafter checkpoints ({', '.join(ddirs)}); "
                             "a server loads one")
    if files[0][0] is None:  # one system file (given, or a directory's lone system.json)
        size = read[0][0]
        if max_num_seqs is not None and size is not None and size != max_num_seqs:  # served, not as judged
            print(f"specpilot serve: warning: {system} was sealed for {size} requests at once; serving it with "
                  f"{max_num_seqs} slots (nothing was measured at that size)", file=sys.stderr)
        config, slots = cfgs[0], max_num_seqs or size or 16
    else:
        sizes = [r[0] for r in read]
        try:
            config = LoadPlan.from_sizes(dict(zip(sizes, cfgs)))
        except SpecPilotError as e:
            raise SpecPilotError(f"--system {system}: {e}") from None
        slots = max_num_seqs or max(sizes)
        if slots < max(sizes):
            print(f"specpilot serve: warning: {slots} slots: the systems sealed for more requests at once "
                  f"({', '.join(str(n) for n in sizes if n > slots)}) never run", file=sys.stderr)
    return Sealed(config, tdir, Path(ddirs[0]) if ddirs else None, device or dep.get("device") or "cpu", slots, src)


def _sized_files(d: Path) -> list[tuple[int, Path]]:
    """The per-size files of a ``pilot --batch`` output directory ``d`` (by size), or its lone ``system.json``."""
    sized = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := SIZED.fullmatch(p.name)))
    if sized:
        for (a, fa), (b, fb) in zip(sized, sized[1:]):
            if a == b:
                raise SpecPilotError(f"--system {d}: two files for batch size {a}: {fa.name} and {fb.name}")
        return sized
    if (d / "system.json").is_file():
        return [(None, d / "system.json")]
    raise SpecPilotError(f"--system {d} is a directory without system_n<N>.json or system.json files (the output "
                         "directory of `specpilot pilot`)")


def _drafter_dir(cfg: SystemConfig, dep: dict) -> tuple[SystemConfig, Optional[Path]]:
    """``cfg`` with its recorded drafter directory found again here, and that directory (None: no checkpoint)."""
    from specpilot.cli import CHECKPOINT_DRAFTERS
    from specpilot.zoo import resolve_recorded

    ddir = cfg.drafter_path or (dep.get("drafter") if dep.get("drafter") not in (None, "ngram") else None)
    ddir = resolve_recorded(ddir) if ddir and cfg.drafter in CHECKPOINT_DRAFTERS else None
    if ddir is not None and cfg.drafter_path is not None:
        cfg = cfg.model_copy(update={"drafter_path": str(ddir)})
    return cfg, ddir


__all__ = ["Sealed", "read_system", "check_seal", "load_sealed"]

"""The batched pilot's journal: every measurement it finished, kept in its output directory so that a run cut short
(a GPU call's time limit, a lost machine) resumes there and measures only what is left (§3.3: the judgements are
pure functions of the measurements, so a resumed run reaches the verdicts an uninterrupted one would).

``journal.json`` holds a header (what the measurements depend on: target, drafter, dtype, device, sizes, rounds,
the request plan, seed, calibration file's content) and one entry per finished measurement under a key naming its
systems and sizes. A run finding a journal with the same header reads its entries instead of measuring again; one
with another header refuses to mix the two. Each entry is written at once (to a temporary file, then renamed), so a
run killed at any point loses at most the measurement in progress. A measurement also names the machine it ran on
(:func:`machine_name`: "cuda" in the header is any GPU), so a run resumed on another machine says whose
measurements its verdicts mix (:meth:`BatchJournal.machines`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from specpilot.errors import SpecPilotError
from specpilot.pilot.batch_runs import BatchMeasured

JOURNAL = "journal.json"


def machine_name(device) -> str:
    """The machine a measurement on ``device`` ran on: the GPU's name on CUDA (``NVIDIA H200``), else the CPU's."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def run_header(opts, sizes, rounds: int) -> dict:
    """What the batched pilot's measurements depend on (JSON-ready): ``opts`` a
    :class:`~specpilot.pilot.state.PilotOptions`."""
    cal = None
    if opts.calibration is not None:
        cal = hashlib.sha256(Path(opts.calibration).read_bytes()).hexdigest()
    return {"target": str(Path(opts.target).resolve()), "drafter": opts.drafter and str(Path(opts.drafter).resolve()),
            "dtype": opts.dtype, "device": opts.device, "threads": opts.threads, "sizes": sorted(sizes),
            "rounds": rounds, "plan": dict(opts.plan), "seed": opts.seed, "calibration_sha256": cal,
            **({"compile_cpu": True} if opts.compile_cpu else {}),  # absent when off: older journals still resume
            **({"prompts_sha256": hashlib.sha256(Path(opts.prompts).read_bytes()).hexdigest()} if opts.prompts else {})}


class BatchJournal:
    """Finished measurements of one batched pilot run in ``out/journal.json`` (module doc).

    Args:
        out: the run's output directory (created by the caller).
        header: :func:`run_header` of this run.
        machine: :func:`machine_name` of this run's device, written with each measurement it makes.
    Attributes:
        resumed: entries found at start (0: a fresh run).
    Raises:
        SpecPilotError: ``out`` holds a journal of a run with another header, or one that is not readable.
    """

    def __init__(self, out: Path, header: dict, machine: str = "unknown"):
        self.machine = machine
        self.path = Path(out) / JOURNAL
        self.header = json.loads(json.dumps(header))  # as it reads back
        self.entries: dict = {}
        if self.path.is_file():
            got = self._read()
            if got["header"] != self.header:
                there, here = _flat(got["header"]), _flat(self.header)
                diff = [f"{k} {_short(there.get(k))} there, {_short(here.get(k))} here"
                        for k in sorted({**there, **here}) if there.get(k) != here.get(k)]
                raise SpecPilotError(f"{self.path.parent} holds a batched pilot run with other options "
                                     f"({'; '.join(diff)}): give another --out, or delete its journal.json to start over")
            self.entries = got["entries"]
        self.resumed = len(self.entries)

    def _read(self) -> dict:
        bad = f"{self.path} is not a readable journal"
        try:
            got = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SpecPilotError(f"{bad} ({e}); delete it to start over") from None
        if (not isinstance(got, dict) or not isinstance(got.get("header"), dict)
                or not isinstance(got.get("entries"), dict)):
            raise SpecPilotError(f"{bad} (no header and entries); delete it to start over")
        return got

    def get(self, key: str):
        """The JSON value journaled under ``key``, or None."""
        return self.entries.get(key)

    def put(self, key: str, value) -> None:
        """Journal ``value`` (JSON-ready) under ``key`` and write the file at once."""
        self.entries[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"header": self.header, "entries": self.entries}), encoding="utf-8")
        os.replace(tmp, self.path)

    def measured(self, key: str, measure) -> tuple[BatchMeasured, bool]:
        """The :class:`BatchMeasured` journaled under ``key``, else ``measure()``'s, journaled; and whether it came
        from the journal."""
        got = self.get(key)
        if got is not None:
            try:
                return measured_from_json(got), True
            except (KeyError, TypeError, ValueError, AttributeError):
                raise SpecPilotError(f"{self.path} is not a readable journal (its entry {key!r} is malformed); "
                                     "delete it to start over") from None
        m = measure()
        self.put(key, {**measured_to_json(m), "machine": self.machine})
        return m, False

    def machines(self) -> dict[str, int]:
        """``{machine: measurements}`` of the journaled measurements ("unknown" for those written before machines
        were named)."""
        out: dict[str, int] = {}
        for v in self.entries.values():
            if isinstance(v, dict) and "tps" in v:
                out[v.get("machine", "unknown")] = out.get(v.get("machine", "unknown"), 0) + 1
        return out


def _flat(header: dict) -> dict:
    """``header`` with each dict value's keys lifted as ``key.sub`` (the plan's fields named one by one)."""
    out = {}
    for k, v in header.items():
        out.update({f"{k}.{s}": x for s, x in v.items()} if isinstance(v, dict) else {k: v})
    return out


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _cell_key(cell) -> str:
    return json.dumps(list(cell))


def _cell(key: str) -> tuple:
    b, n, r = json.loads(key)
    return b, int(n), int(r)


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def measured_to_json(m: BatchMeasured) -> dict:
    """``m`` as JSON-ready dicts (cells as ``'["bench", size, round]'`` keys); :func:`measured_from_json` inverts."""
    by_cell = lambda d: {_cell_key(c): v for c, v in d.items()}  # noqa: E731
    return {"tps": {k: by_cell(v) for k, v in m.tps.items()}, "outputs": {k: by_cell(v) for k, v in m.outputs.items()},
            "prompts": by_cell(m.prompts), "outside": {k: list(v) for k, v in m.outside.items()},
            "nondeterministic": dict(m.nondeterministic)}


def measured_from_json(d: dict) -> BatchMeasured:
    """The :class:`BatchMeasured` of :func:`measured_to_json`'s dict (token lists back to tuples)."""
    by_cell = lambda x, f: {_cell(c): f(v) for c, v in x.items()}  # noqa: E731
    return BatchMeasured({k: by_cell(v, float) for k, v in d["tps"].items()},
                         {k: by_cell(v, _tuples) for k, v in d["outputs"].items()}, by_cell(d["prompts"], _tuples),
                         {k: tuple(v) for k, v in d["outside"].items()}, dict(d["nondeterministic"]))

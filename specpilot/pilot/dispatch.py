"""Where the pilot's judgements run: executors per device slot, concurrent judging, the agent round (§3.3).

**Device rule** (``specpilot pilot --devices d0,d1,...``, default ``--device`` alone):

- *Executor.* ``local`` (in-process, one device) when one device is given and no ``--agent``; otherwise
  ``workers`` (:mod:`specpilot.pilot.workers`): every system runs in a worker process. ``--executor``
  forces either (``local`` refuses several devices or an agent: code candidates need their own process).
- *Slots.* With ``--paired-devices`` (default: on iff exactly two devices are given) devices are taken in
  consecutive pairs, each pair one two-device judgement (A on one device, B on the other, swapped);
  ``D / 2`` slots (D must be even). Otherwise each device is one slot with A and B
  interleaved A B B A on it (one worker per source tree); ``D`` slots. A round's candidates are judged concurrently,
  one per slot; Phase 0, the agent's candidate and the seal use slot 0.
- *Threads.* On the CPU each worker gets ``max(1, torch threads // D)`` intra-op threads (D workers run
  at once).

**Agent round.** With ``--agent`` the pilot calls the agent once per round, *after* the round's config
candidates (so the brief names the round's final incumbent): a scratch worktree of the stock commit plus
the incumbent's code entries under ``<out>/agent/round-N/tree``, a brief (ceiling factors, gap, memory,
allowlist) under ``<out>/agent/round-N``; its patch is judged as B (same config, the worktree's code,
in a worker) against the incumbent A (stock code or the last approved worktree) through the same
controller and token forcing; approved, it becomes a memory entry of kind ``patch`` and the incumbent's
code (later config candidates and the seal run on it, in workers).

**Limits.** Profiling, live screening and the ceiling run in the pilot's own process on the stock code of
a config: an approved patch enters the pilot only through the controller's measurements. The agent's
worktree is a plain directory trusted to hold the patch the diff shows (no sandbox); a worktree whose
``specpilot`` cannot be imported or built is rejected through the worker's error. Only one agent is
called per round (no per-direction sub-agents on several devices yet).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.agent import ALLOWED, FORBIDDEN, AgentPatch, AgentRejected, prepare_worktree, run_agent, write_brief
from specpilot.pilot.memory import Entry, Evidence
from specpilot.pilot.patches import head_state
from specpilot.pilot.workers import DeploymentSpec, WorkerError, WorkerExecutor, WorkerPool, WorkerSystem


@dataclass
class Dispatch:
    """Executors of one pilot run (see the module doc for the rule).

    Attributes:
        mode: ``local`` or ``workers``. slots: device tuples, one judgement each at a time.
        dep: what workers load (None in local mode). threads: torch threads per worker.
        pool: idle stock-code workers reused from one judgement to the next (:class:`WorkerPool`);
            :meth:`close` stops them.
    """

    mode: str
    slots: list[tuple[str, ...]]
    dep: DeploymentSpec | None = None
    threads: int | None = None
    timeout_s: float = 600.0
    _free: queue.Queue = field(default_factory=queue.Queue, repr=False)
    pool: WorkerPool = field(default_factory=WorkerPool, repr=False)  # stock workers reused across judgements

    def __post_init__(self):
        for i in range(len(self.slots)):
            self._free.put(i)

    def executor(self, slot: int = 0):
        """The controller executor of ``slot`` (None = the controller's in-process default)."""
        if self.mode == "local":
            return None
        return WorkerExecutor(self.dep, self.slots[slot], self.threads, self.timeout_s, self.pool)

    def close(self) -> None:
        """Stop the idle pooled workers (the end of a pilot run)."""
        self.pool.close()

    def system(self, make_local: Callable[[], object], config, tree: str | Path | None = None):
        """What the executor takes for a system: the factory (local) or a :class:`WorkerSystem` of
        ``config`` (a SystemConfig) on ``tree`` (None: stock code)."""
        if self.mode == "local":
            if tree is not None:
                raise SpecPilotError("a code candidate needs the worker executor")
            return make_local
        return WorkerSystem(config.model_dump(), str(tree) if tree is not None else None)

    def map(self, jobs: Sequence[Callable[[object], object]]) -> list:
        """Run ``jobs`` (each called with an executor) concurrently, one per free slot; results in order.
        An exception of a job is returned in its place (the pilot rejects that candidate and goes on)."""
        def one(job):
            slot = self._free.get()
            try:
                return job(self.executor(slot))
            except (WorkerError, SpecPilotError, ValueError) as e:
                return e
            finally:
                self._free.put(slot)

        if len(self.slots) == 1 or len(jobs) <= 1:
            return [one(j) for j in jobs]
        with cf.ThreadPoolExecutor(max_workers=len(self.slots)) as pool:
            return list(pool.map(one, jobs))


def plan_dispatch(device: str, devices: Sequence[str] = (), paired: bool | None = None, executor: str = "auto",
                  agent: bool = False, dep: DeploymentSpec | None = None, cpu_threads: int = 1,
                  timeout_s: float = 600.0) -> Dispatch:
    """The :class:`Dispatch` of a pilot run by the rule of the module doc.

    Args:
        device: ``--device``; devices: ``--devices`` (empty: ``(device,)``); paired: ``--paired-devices``
            (None: auto); executor: ``auto`` | ``local`` | ``workers``; agent: ``--agent`` given;
        dep: the deployment for workers; cpu_threads: the parent's torch threads.
    Raises:
        SpecPilotError: an unknown executor, ``local`` with several devices or an agent, paired devices
            with fewer than two devices, or workers without ``dep``.
    """
    devs = tuple(devices) or (device,)
    if executor not in ("auto", "local", "workers"):
        raise SpecPilotError(f"--executor must be auto, local or workers, got {executor!r}")
    if executor == "local" and (len(devs) > 1 or agent):
        raise SpecPilotError("--executor local runs one device in-process: drop --devices/--agent or use workers")
    mode = executor if executor != "auto" else ("workers" if len(devs) > 1 or agent else "local")
    paired = (len(devs) == 2) if paired is None else paired
    if paired and (len(devs) < 2 or len(devs) % 2):
        raise SpecPilotError(f"--paired-devices needs an even number of devices (--devices d0,d1[,d2,d3]); "
                             f"got {len(devs)}: drop one or use --no-paired-devices")
    if mode == "local":
        return Dispatch("local", [devs])
    if dep is None:
        raise SpecPilotError("the worker executor needs the deployment (checkpoint directories) to load")
    slots = [devs[i : i + 2] for i in range(0, len(devs) - 1, 2)] if paired else [(d,) for d in devs]
    threads = max(1, cpu_threads // len(devs)) if all(d.startswith("cpu") for d in devs) else None
    return Dispatch("workers", slots, dep, threads, timeout_s)


@dataclass
class AgentContext:
    """What one agent round needs from the pilot (plain data, so tests can build it).

    Attributes:
        template / timeout_s: ``--agent`` command template and its timeout (s).
        workdir: ``<out>/agent/round-N``. repo / commit: the package's git checkout and the stock commit.
        code_entries: approved patch entries of the incumbent, in order. requires: ids of all entries so far.
        config: the incumbent's SystemConfig; tree: the incumbent's code tree (None: stock).
        controller / requests: the Phase 0 controller and the request set. sigma: stock σ.
        brief: cost model, gap, memory lines (merged into the brief). deployment: for the evidence.
    """

    template: str
    timeout_s: float
    workdir: Path
    repo: Path
    commit: str
    code_entries: list[Entry]
    requires: list[str]
    config: object
    tree: str | None
    controller: ctl.Controller
    requests: Sequence[ctl.Req]
    sigma: float
    brief: dict
    deployment: dict


@dataclass
class AgentOutcome:
    """Result of :func:`agent_round`: the report ``row``, the new ``entry`` (approved) and its ``patch``."""

    row: dict
    entry: Entry | None = None
    patch: AgentPatch | None = None


def agent_round(rnd: int, c: AgentContext, dispatch: Dispatch, progress=None, date: str = "") -> AgentOutcome:
    """Call the agent, check its patch, judge it against the incumbent, and make the memory entry (§3.3, §3.5).

    Never raises for a bad agent: failures, timeouts, empty or disallowed patches, workers that die on
    the patched code, and rejections by the controller or token forcing come back as a rejected row.

    Raises:
        SpecPilotError: the worktree cannot be prepared (no git checkout, incumbent patch not applying)
            or the template is malformed.
    """
    name = f"agent patch (round {rnd})"
    row = {"round": rnd, "name": name, "config": c.config.model_dump(), "predicted": None, "gain": None,
           "lower_bound": None, "bar": None, "outputs_differ": None, "forcing_passed": None, "forcing_reasons": [],
           "mismatch_rate": None, "approved": False, "agent": {"workdir": str(c.workdir)}}
    tree_dir = c.workdir / "tree"
    if tree_dir.exists():  # a scratch tree of an earlier run into the same --out (its patch is in memory)
        shutil.rmtree(tree_dir)
    base = prepare_worktree(c.repo, c.commit, [(e.id, e.delta) for e in c.code_entries], tree_dir)
    brief = {"goal": "Make greedy decoding of this deployment faster without changing its output (lossless).",
             "allowed": list(ALLOWED), "forbidden": list(FORBIDDEN), "contract": "output == AR greedy in float32; "
             "token forcing against the FP32-head scorer passes", "incumbent": c.config.model_dump(),
             "stock_commit": c.commit, "code_entries": [e.id for e in c.code_entries], **c.brief}
    md = write_brief(c.workdir, brief)
    try:
        patch = run_agent(c.template, md, tree_dir, base, c.timeout_s)
    except AgentRejected as e:
        row["reason"] = f"rejected: {e}"
        return AgentOutcome(row)
    row["agent"].update({"files": list(patch.files), "tree": patch.tree})
    a = dispatch.system(None, c.config, c.tree)
    b = dispatch.system(None, c.config, tree_dir)
    [j] = dispatch.map([lambda ex: c.controller.judge(a, b, c.requests, progress=progress, executor=ex)])
    if isinstance(j, Exception):
        row["reason"] = f"rejected: {str(j).splitlines()[0] if str(j) else type(j).__name__}"
        return AgentOutcome(row, patch=patch)
    v = j.verdict
    row.update({"gain": j.run.gain, "lower_bound": j.run.lower_bound, "bar": v.bar, "outputs_differ": j.run.outputs_differ,
                "forcing_passed": j.forcing_passed, "forcing_reasons": list(j.forcing_reasons),
                "mismatch_rate": j.forcing.mismatch_rate, "approved": v.approved, "reason": v.reason})
    if not v.approved:
        return AgentOutcome(row, patch=patch)
    entry = Entry(
        id=f"r{rnd}-agent-patch", title=f"agent patch: {', '.join(patch.files)[:120]}", mechanism="agent-patch",
        kind="patch", requires=list(c.requires), delta=patch.patch,
        evidence=Evidence(gain=j.run.gain, lower_bound=j.run.lower_bound, bar=v.bar, sigma=c.sigma,
                          forcing=j.forcing.to_dict(), deployment=c.deployment, date=date),
        base={"commit": c.commit}, system={"tree": patch.tree, "files": list(patch.files)},
        limits=["measured on this deployment and device only; re-measure on a new one",
                "the pilot's cost model and screening profile the stock code of the config, not this patch"],
        not_verified=["batching (batch 1 only)", "other dtypes / devices than the one in evidence"],
    )
    row["entry"] = entry.id
    return AgentOutcome(row, entry, patch)


def stock_commit(repo: Path) -> tuple[str, bool]:
    """(HEAD commit of ``repo``, whether tracked files under ``specpilot/`` differ from it).

    Raises:
        SpecPilotError: ``repo`` is not a git checkout (``--agent`` needs one).
    """
    try:
        commit, _, dirty = head_state(repo, ("specpilot",))
    except ValueError as e:
        raise SpecPilotError(f"--agent needs specpilot in a git checkout ({repo}: {e})") from None
    return commit, dirty

"""Controller worker processes: A and B in separate processes, on one device or two swapped (§3.3).

A :class:`Worker` is one subprocess bound to one device and one source tree (default: the stock package
this module belongs to; for a code candidate, a scratch worktree). It runs the stock entry script
:mod:`specpilot.pilot.worker_main` *by file path*, which binds the clock, the device synchronisation and
the thread listing before the tree's ``specpilot`` is importable, then loads the deployment, builds one
system from a :class:`~specpilot.config.SystemConfig` (untimed) and answers timed requests. JSON lines
over pipes; the worker's stderr goes to a file whose tail is quoted when it dies.

:class:`WorkerExecutor` is the controller's executor over workers (see
:class:`specpilot.pilot.paired.LocalExecutor` for the session interface): with one device, A and B
run one at a time A B B A; with two devices, A on device 0 and B on device 1 run concurrently on the
first variant of a request, then swapped (A on 1, B on 0) on the second. Systems of the same source tree
share one worker per device (built under separate keys), so process-to-process differences cancel like
device differences do; a system from another tree gets its own worker. The parent keeps salts, order, comparisons, bootstrap and token
forcing; workers only build, run and time.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specpilot.errors import SpecPilotError

#: the stock source tree (the directory holding this ``specpilot`` package) and the stock entry script
STOCK_TREE = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).resolve().with_name("worker_main.py")


class WorkerError(SpecPilotError):
    """A worker process died, timed out, could not load the deployment or build its system, or a request
    failed in it; the message is one line (the worker's error text or the tail of its stderr)."""


@dataclass(frozen=True)
class DeploymentSpec:
    """What every worker loads (the arguments of :class:`~specpilot.engine.deployment.Deployment`):
    checkpoint directories (absolute), dtype, block and EAGLE-3 drafter directories and the aligned kernels' choice."""

    target: str
    drafter: str | None = None
    dtype: str = "float32"
    blocks: tuple[str, ...] = ()
    aligned: bool = False
    eagle3: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerSystem:
    """A system as a worker builds it: ``config`` (``SystemConfig.model_dump()``) and ``tree``, the source
    tree whose ``specpilot`` runs it (None: the stock tree :data:`STOCK_TREE`)."""

    config: dict
    tree: str | None = None


def _reap(proc: subprocess.Popen, log: str) -> None:
    """Kill ``proc`` if it still runs and remove its log file (a worker's finalizer)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    Path(log).unlink(missing_ok=True)


class Worker:
    """One worker subprocess on ``device`` running ``tree``'s code over the deployment ``dep``.

    Args:
        dep: the deployment to load. device: torch device string (``cpu``, ``cuda:1``).
        tree: source tree (None: stock). threads: torch intra-op threads in the worker (None: torch's
            default there). timeout_s: seconds any one reply may take (load, build, one request).
    The process starts at construction; :meth:`ready` waits for the deployment to load.
    Raises:
        WorkerError: the process cannot be started.
    """

    def __init__(self, dep: DeploymentSpec, device: str, tree: str | None = None, threads: int | None = None,
                 timeout_s: float = 600.0):
        self.device, self.tree, self.timeout_s = device, str(tree or STOCK_TREE), timeout_s
        self.key = (dep, device, self.tree, threads)  # what a pooled worker can be reused for
        self._log = tempfile.NamedTemporaryFile(prefix="specpilot-worker-", suffix=".log", delete=False)
        env = dict(os.environ)  # PYTHONPATH keeps its dependency dirs, minus any that hold a specpilot package:
        keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)  # the tree alone provides it
                if p and not os.path.exists(os.path.join(p, "specpilot", "__init__.py"))]
        env["PYTHONPATH"] = os.pathsep.join(keep)
        try:
            self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=self.tree)
        except OSError as e:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            raise WorkerError(f"cannot start a worker on {device}: {e}") from None
        self._buf = b""
        self.info: dict | None = None
        # a worker never closed (a pool left open, an interrupted run) is stopped and its log removed at exit
        self._finalizer = weakref.finalize(self, _reap, self.proc, self._log.name)
        try:
            self.send({"tree": self.tree, "device": device, "dtype": dep.dtype, "target": dep.target,
                       "drafter": dep.drafter, "blocks": list(dep.blocks), "threads": threads,
                       "aligned": dep.aligned, "eagle3": list(dep.eagle3)})
        except BaseException:
            self.kill()
            self.close()
            raise

    def __repr__(self) -> str:
        return f"worker {self.proc.pid} on {self.device} ({self.tree})"

    def send(self, msg: dict) -> None:
        """Write one request line. Raises WorkerError when the worker has gone."""
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died() from None

    def recv(self) -> dict:
        """Read one reply (waiting at most ``timeout_s``); a reply ``{"ok": false}`` raises.

        Raises:
            WorkerError: the worker died, timed out (it is then killed) or reported an error.
        """
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"{self}: no reply within {self.timeout_s:.0f} s (killed)")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise self._died()
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            raise WorkerError(f"{self}: garbled reply {line[:80]!r}") from None
        if not msg.get("ok"):
            raise WorkerError(f"{self}: {msg.get('error', 'failed')}")
        return msg

    def request(self, msg: dict) -> dict:
        """:meth:`send` then :meth:`recv`."""
        self.send(msg)
        return self.recv()

    def ready(self) -> dict:
        """Wait for the init reply (deployment loaded); returns it (``vocab_size``, ``specpilot`` path)."""
        if self.info is None:
            self.info = self.recv()
        return self.info

    def _died(self) -> WorkerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = [ln for ln in Path(self._log.name).read_text(errors="replace").splitlines() if ln.strip()]
        return WorkerError(f"{self} died (exit code {code}): {tail[-1] if tail else 'no output'}")

    def kill(self) -> None:
        """Stop the process (no-op when it has exited)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Ask the worker to quit (kill it if it does not within 10 s) and remove its log."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._log.close()
        self._finalizer()


class WorkerPool:
    """Idle workers kept between controller runs, so a large target is loaded once per device instead of
    once per paired run (four loads per two-device judgement otherwise).

    Only workers on the stock tree come back: a system built from a config runs stock code, which leaves
    nothing behind but its (freed) engine; a worker that ran a patched tree, or whose session failed, is
    closed. Thread-safe (the pilot judges on several slots at once)."""

    def __init__(self):
        self._idle: dict[tuple, list[Worker]] = {}
        self._lock = threading.Lock()

    def take(self, dep: DeploymentSpec, device: str, tree: str | None, threads: int | None, timeout_s: float) -> Worker:
        """An idle live worker for (dep, device, tree, threads), or a new one. Raises WorkerError."""
        key = (dep, device, str(tree or STOCK_TREE), threads)
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                w = idle.pop()
                if w.proc.poll() is None:
                    return w
                w.close()
        return Worker(dep, device, tree, threads, timeout_s)

    def give(self, w: Worker) -> None:
        """Return ``w`` after a successful session (stock tree, still alive), else close it."""
        if w.tree != str(STOCK_TREE) or w.proc.poll() is not None or w.info is None:
            w.close()
            return
        try:
            w.request({"op": "drop"})  # the session's systems are freed, not kept until the next build
        except WorkerError:
            w.close()
            return
        with self._lock:
            self._idle.setdefault(w.key, []).append(w)

    def close(self) -> None:
        """Stop every idle worker."""
        with self._lock:
            idle, self._idle = [w for ws in self._idle.values() for w in ws], {}
        for w in idle:
            w.close()


@dataclass
class WorkerExecutor:
    """The controller's executor over worker processes (§3.3); pass it as ``executor=`` to
    :func:`~specpilot.pilot.paired.paired_run`, ``interleaved_run``, ``phase0`` or ``Controller.judge``.

    Attributes:
        dep: the deployment every worker loads. devices: one device (A and B run one at a time, A B B A)
            or two (A and B concurrently on different devices, swapped between the two variants of a
            request); one worker per source tree and device. More than two systems (the seal's interleaved run) use ``devices[0]``.
        threads: torch threads per worker (None: torch's default in the worker).
        timeout_s: seconds one reply may take (deployment load, build, one request).
        pool: a :class:`WorkerPool` to take workers from and return them to (None: every session starts
            and stops its own).
    Raises (from the session): WorkerError.
    """

    dep: DeploymentSpec
    devices: Sequence[str] = ("cpu",)
    threads: int | None = None
    timeout_s: float = 600.0
    pool: WorkerPool | None = None

    def __post_init__(self):
        if len(self.devices) not in (1, 2):
            raise SpecPilotError(f"a worker executor takes one or two devices, got {list(self.devices)}")

    def open(self, makers: dict[str, WorkerSystem]) -> "WorkerSession":
        """Start (and load) the workers for ``makers`` (``{name: WorkerSystem}``); see the module doc."""
        for n, m in makers.items():
            if not isinstance(m, WorkerSystem):
                raise TypeError(f"system {n!r}: a worker executor takes WorkerSystem specs, got {type(m).__name__}")
        return WorkerSession(self, dict(makers))


class WorkerSession:
    """Workers of one controller run; the interface of :class:`~specpilot.pilot.paired.LocalExecutor`'s
    sessions (``schedule``, ``build``, ``run``, ``close``).

    Systems that run the same source tree share one worker process per device (each built under its own
    key), so a difference between two processes (memory placement, scheduling) cannot pass for a
    difference between the systems: A B B A within one process, as in-process. Systems from different
    trees (a code candidate) need their own processes, and a speed difference between those two processes
    is not cancelled (nor yet measured): it enters the candidate's gain."""

    def __init__(self, ex: WorkerExecutor, makers: dict[str, WorkerSystem]):
        self.makers, self.names = makers, list(makers)
        self.swapped = len(ex.devices) == 2 and len(makers) == 2
        self.home: dict[str, tuple[str, int]] = {}  # "name@i" -> (tree, device index) of its worker
        for i in ((0, 1) if self.swapped else (0,)):
            for n in self.names:
                self.home[f"{n}@{i}"] = (str(makers[n].tree or STOCK_TREE), i)
        self.workers: dict[tuple[str, int], Worker] = {}
        self.pool, self.failed = ex.pool, False
        try:
            for tree, i in dict.fromkeys(self.home.values()):  # all start at once: loading is the slow part
                self.workers[(tree, i)] = (ex.pool.take if ex.pool else Worker)(
                    ex.dep, ex.devices[i], tree, ex.threads, ex.timeout_s)
            for w in self.workers.values():
                w.ready()
        except BaseException:
            self.failed = True
            self.close()
            raise

    def schedule(self, parity: int) -> list[list[tuple[str, str]]]:
        """One variant's runs: swapped placement on two devices, else A B (parity 0) / B A (parity 1)."""
        if self.swapped:
            a, b = self.names
            return [[(a, f"{a}@0"), (b, f"{b}@1")]] if parity == 0 else [[(a, f"{a}@1"), (b, f"{b}@0")]]
        names = self.names if parity == 0 else self.names[::-1]
        return [[(n, f"{n}@0")] for n in names]

    def build(self) -> dict[str, list[str]]:
        """Build every system in its worker (untimed, all workers at once); returns ``{key: thread names
        left running}``."""
        try:
            for k, home in self.home.items():
                self.workers[home].send({"op": "build", "config": self.makers[k.rsplit("@", 1)[0]].config, "key": k})
            return {k: self.workers[home].recv()["outside"] for k, home in self.home.items()}
        except BaseException:
            self.failed = True
            raise

    def run(self, group, prompt, max_new) -> list[tuple[tuple[int, ...], float, list[str]]]:
        """Time ``prompt`` on every system of ``group`` concurrently (one worker each, by construction:
        a group's systems are on different devices); [(tokens, seconds, threads left)]."""
        msg = {"op": "run", "prompt": [int(t) for t in prompt], "max_new": int(max_new)}
        try:
            for _, k in group:
                self.workers[self.home[k]].send({**msg, "key": k})
            replies = [self.workers[self.home[k]].recv() for _, k in group]
        except BaseException:
            self.failed = True
            raise
        return [(tuple(r["tokens"]), float(r["seconds"]), r["outside"]) for r in replies]

    def close(self) -> None:
        """Return the workers to the pool after a clean session, else stop them."""
        for w in self.workers.values():
            if self.pool is not None and not self.failed:
                self.pool.give(w)
            else:
                w.close()

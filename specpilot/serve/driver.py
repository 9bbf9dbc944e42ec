"""The engine's one thread: requests and aborts come in through a queue, step outputs go out to each request.

A :class:`~specpilot.engine.batch.BatchEngine` is not thread-safe, so one background thread owns it
(:class:`EngineDriver`). The server's event loop hands it requests (:meth:`EngineDriver.submit`) and aborts
(:meth:`EngineDriver.abort`) through a thread-safe queue; the thread adds them to the engine between steps, calls
``step()`` while there is work, and hands each :class:`StepOutput` to its request's ``deliver`` callback (the server
passes a :class:`LoopSink`, which puts the item on the request's asyncio queue with ``loop.call_soon_threadsafe``).
A step's outputs for :class:`LoopSink` s of one event loop go over in one ``call_soon_threadsafe``
(:meth:`EngineDriver._deliver`).

Per request the callback receives, in order: :data:`ADMITTED` once the engine took the request (or one
:class:`Failure` with status 400 if it refused it), then its step outputs until one is ``finished``. An exception
raised by ``step()`` fails every request the engine held (a batched step touches them all and leaves their state
unknown) with a 500 :class:`Failure`, aborts them in the engine to free their slots, and the thread goes on serving
new requests. An aborted request gets nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specpilot.errors import SpecPilotError

log = logging.getLogger("specpilot.serve")

#: delivered once the engine accepted a request
ADMITTED = "admitted"


class LoopSink:
    """A ``deliver`` callback that puts items on an asyncio queue of ``loop`` (``put``: the queue's ``put_nowait``).

    Why a class and not a lambda: the driver sees the loop, so a step's outputs for every request of one loop cross
    threads in one ``call_soon_threadsafe`` (one wake-up of the event loop per step) instead of one each. On a CPU
    whose cores all run the engine's OpenMP threads, each wake-up of the event loop's thread took a core from them
    mid-step and handed the GIL back and forth with the engine thread between outputs.

    ``coalesce``: after the request's first output, hold its step outputs in the engine thread and deliver them as one
    :class:`Coalesced` when it finishes. For a non-streamed request without stop strings, whose text is only read at
    the end and which nothing but the engine's own stops can end early: the event loop's thread then wakes once for
    it, not once a step, and takes no core and no GIL from the engine while it runs.
    """

    __slots__ = ("loop", "put", "coalesce")

    def __init__(self, loop, put: Callable[[object], None], coalesce: bool = False):
        self.loop, self.put, self.coalesce = loop, put, coalesce

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.put, item)


def _put_all(pairs: list) -> None:
    """Run on the event loop: hand each ``(put, item)`` of one step over."""
    for put, item in pairs:
        put(item)


@dataclass
class Coalesced:
    """A coalescing :class:`LoopSink`'s last item: ``output``, its request's final StepOutput whose ``new_tokens``
    are every token since its first output, and ``stamps``, the ``time.perf_counter()`` at which each held step that
    committed tokens (the final one included) ended, for the inter-token latencies."""

    output: object
    stamps: list[float]


@dataclass
class Failure:
    """A request the engine refused (``status`` 400) or failed (500; 503 when the server stops)."""

    status: int
    message: str


class EngineDriver:
    """Owns ``engine`` in a background thread (start it with :meth:`start`).

    Args:
        engine: a BatchEngine (``add_request``, ``abort_request``, ``step``, ``has_work``, ``free_slots``,
            ``num_waiting``, ``reset``, ``num_slots``).
        metrics: a :class:`~specpilot.serve.metrics.ServerMetrics` (None: no metrics).
        idle_wait_s: how long the idle thread waits for a request before checking for a stop, seconds.
    Attributes:
        steps: engine steps run; failures: steps that raised; free_slots: the engine's free slots after the last
            loop (read by tests and ``/health``; written by the engine thread only).
    """

    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.5):
        self.engine, self.metrics, self.idle_wait_s = engine, metrics, idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[object], None]] = {}
        self._held: dict[str, tuple[list[int], list[float]]] = {}  # coalescing sinks: tokens and stamps so far
        self._stop = threading.Event()
        # _sinks / _held belong to the engine thread; a stop whose step runs long fails them from the stopping thread
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="specpilot-engine", daemon=True)
        self.steps = self.failures = 0
        self.num_slots = int(engine.num_slots)
        self.free_slots = self.num_slots

    # -- the event loop's side -------------------------------------------------------------------------
    def start(self) -> "EngineDriver":
        """Start the engine thread (once; a second call does nothing); returns self."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    def submit(self, request, deliver: Callable[[object], None]) -> None:
        """Queue ``request`` (a :class:`~specpilot.engine.batch.Request`) for the engine; ``deliver(item)`` is called
        from the engine thread with :data:`ADMITTED`, :class:`Failure` s and step outputs (it must not block)."""
        self._inbox.put(("add", request, deliver))

    def abort(self, request_id: str) -> None:
        """Queue an abort: the engine frees the request's slot and it gets no more outputs (a finished or unknown
        id is ignored)."""
        self._inbox.put(("abort", request_id, None))

    def stop(self, timeout_s: float = 10.0, fail_after_s: float = 0.5) -> None:
        """Stop the thread; requests still held get a 503 :class:`Failure` and the engine is reset. If the thread's
        current step runs past ``fail_after_s`` seconds (a slow machine), the 503s go out at once from this thread,
        so that they reach the clients before the server's grace period ends; the step's outputs are then dropped."""
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread.is_alive():
            self._thread.join(fail_after_s)
        if self._thread.is_alive():
            self._fail_sinks(Failure(503, "the server is shutting down"))
            self._thread.join(max(timeout_s - fail_after_s, 0.0))

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            cmds = []
            if not self._busy():
                try:
                    cmds.append(self._inbox.get(timeout=self.idle_wait_s))
                except queue.Empty:
                    continue
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, arg, deliver in cmds:
                if kind == "add":
                    self._add(arg, deliver)
                elif kind == "abort":
                    self._abort(arg)
            if not self._stop.is_set() and self._busy():
                self._step()
            self._gauges()
        self._fail_all(Failure(503, "the server is shutting down"))
        self._gauges()

    def _busy(self) -> bool:
        try:
            return bool(self.engine.has_work())
        except Exception:  # an engine that cannot say: treat as busy, the step will fail and free it
            log.exception("engine.has_work() raised")
            return bool(self._sinks)

    def _push(self, rid: str, deliver, item) -> bool:
        try:
            deliver(item)
            return True
        except RuntimeError:  # the request's event loop is closed (server shutting down): nobody listens
            self._drop(rid)
            return False

    def _drop(self, rid: str) -> None:
        """Forget a request nobody listens to any more (its event loop closed) and end it in the engine."""
        with self._lock:
            self._sinks.pop(rid, None)
            self._held.pop(rid, None)
        self._abort_engine(rid)

    def _add(self, req, deliver) -> None:
        try:
            self.engine.add_request(req)
        except SpecPilotError as e:  # PromptError and kin: the client's input
            self._push(req.request_id, deliver, Failure(400, str(e)))
            return
        except Exception as e:
            log.exception("engine.add_request raised")
            self._push(req.request_id, deliver, Failure(500, f"the engine could not take the request: "
                                                             f"{type(e).__name__}: {e}"))
            return
        with self._lock:
            self._sinks[req.request_id] = deliver
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(req.prompt_ids))
        self._push(req.request_id, deliver, ADMITTED)

    def _abort(self, rid: str) -> None:
        with self._lock:
            self._held.pop(rid, None)
            held = self._sinks.pop(rid, None)
        if held is not None:
            self._abort_engine(rid)

    def _abort_engine(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("engine.abort_request(%r) raised", rid)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:
            self.failures += 1
            log.exception("engine.step() raised; failing the %d requests it held", len(self._sinks))
            self._fail_all(Failure(500, f"the engine failed on a step that held this request: {type(e).__name__}: "
                                        f"{str(e).splitlines()[0] if str(e) else ''}"))
            return
        self.steps += 1
        if self.metrics is not None:
            self.metrics.step(outs)
            if self.engine.prefix is not None:
                self.metrics.prefix(self.engine.prefix.queried_tokens, self.engine.prefix.reused_tokens)
            self.metrics.plan(self.engine.plan.sizes, self.engine.plan_steps)
        with self._lock:  # a stop may have failed the requests while the step ran: then _sinks is empty
            self._deliver(outs)
        log.debug("step of %d outputs in %.1f ms", len(outs), 1e3 * (time.perf_counter() - t0))

    def _deliver(self, outs) -> None:
        by_loop: dict = {}  # LoopSink outputs, one call_soon_threadsafe per loop (LoopSink's why)
        now = time.perf_counter()
        for o in outs:
            deliver = self._sinks.get(o.request_id)
            if deliver is None:  # aborted while its step ran
                continue
            if o.finished:
                del self._sinks[o.request_id]
            if isinstance(deliver, LoopSink):
                item = self._coalesce(o, now) if deliver.coalesce else o
                if item is not None:
                    by_loop.setdefault(deliver.loop, []).append((o.request_id, deliver.put, item))
            else:
                self._push(o.request_id, deliver, o)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(put, o) for _, put, o in items])
            except RuntimeError:  # the loop is closed (server shutting down): nobody listens
                for rid, _, _ in items:
                    self._drop(rid)

    def _coalesce(self, o, now: float):
        """What a coalescing sink gets of ``o``: its first output as it is, then nothing (held) until the finished
        one, which goes as a :class:`Coalesced` of every held token."""
        held = self._held.get(o.request_id)
        if held is None:
            if not o.finished:
                self._held[o.request_id] = ([], [])
            return o
        held[0].extend(o.new_tokens)
        if o.new_tokens:
            held[1].append(now)
        if not o.finished:
            return None
        del self._held[o.request_id]
        return Coalesced(dataclasses.replace(o, new_tokens=held[0]), held[1])

    def _fail_sinks(self, failure: Failure) -> None:
        """Deliver ``failure`` to every request still held and forget them (any thread)."""
        with self._lock:
            held, self._sinks = self._sinks, {}
            self._held.clear()
            for deliver in held.values():
                try:
                    deliver(failure)
                except RuntimeError:
                    pass

    def _fail_all(self, failure: Failure) -> None:
        self._fail_sinks(failure)
        try:
            self.engine.reset()  # every request it held failed: back to a known state, every slot free
        except Exception:
            log.exception("engine.reset() raised")

    def _gauges(self) -> None:
        try:
            self.free_slots = int(self.engine.free_slots())
        except Exception:
            log.exception("engine.free_slots() raised")
            return
        if self.metrics is not None:
            self.metrics.queue(self.num_slots - self.free_slots, self.engine.num_waiting(), self.num_slots)

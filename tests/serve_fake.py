"""A scripted stand-in for the batched engine (the BatchEngine interface) and a uvicorn server in a thread, for the
server's tests.

:class:`FakeBatchEngine` "decodes" deterministically: every request's output is :data:`SCRIPT`'s token ids (cycled),
1-3 of them committed per step per request (a pattern of the step number), with drafted / accepted counts like a
speculative engine's. Markers in a prompt's text change that: ``[eos:N]`` ends the output with EOS after N script
tokens; ``[fail]`` makes ``step()`` raise while the request is held; ``[slow]`` makes every step that holds the
request sleep 50 ms. It takes and returns the engine's own ``Request`` and ``StepOutput``, honours ``max_new_tokens``,
stop ids, ``num_slots`` (others wait) and aborts, and checks that only one thread ever calls it.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import uvicorn

from specpilot.config import SystemConfig
from specpilot.engine.batch import StepOutput
from specpilot.engine.load_plan import LoadPlan
from specpilot.errors import PromptError

#: multi-byte characters split across byte-level tokens, and a stop string ("STOP") split across two tokens
SCRIPT = "héllo wörld 日本語 🙂 The answer is 42. STOP here; then more text follows.\n"


class FakeBatchEngine:
    """See the module docstring. ``step_delay_s``: sleep per step (so a stream lasts a while)."""

    prefix = None  # no prompt prefixes reused (BatchEngine.prefix)
    plan = LoadPlan.single(SystemConfig.ar())  # one system at every load (BatchEngine.plan); no step counted
    plan_steps = (0,)

    def __init__(self, tokenizer, eos_id: int, max_len: int = 256, num_slots: int = 4, step_delay_s: float = 0.0):
        self.tok, self.eos, self.max_len, self.num_slots = tokenizer, eos_id, max_len, num_slots
        self.vocab_size = len(tokenizer)
        self.script = tokenizer(SCRIPT, add_special_tokens=False)["input_ids"]
        self.step_delay_s = step_delay_s
        self.running: dict[str, dict] = {}
        self.waiting: list[dict] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.added: list[str] = []
        self.steps = 0
        self.resets = 0
        self.threads: set[int] = set()

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())
        assert len(self.threads) == 1, "BatchEngine called from more than one thread"

    def expected(self, max_new: int, eos_after: int | None = None) -> list[int]:
        """The tokens a request gets (before stop strings)."""
        out = [self.script[i % len(self.script)] for i in range(max_new)]
        if eos_after is not None and eos_after < max_new:
            out = out[:eos_after] + [self.eos]
        return out

    def add_request(self, req) -> None:
        self._touch()
        ids = list(req.prompt_ids)
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) + req.max_new_tokens > self.max_len:
            raise PromptError(f"prompt of {len(ids)} tokens + max_new_tokens {req.max_new_tokens} exceeds the context "
                              f"of {self.max_len} tokens")
        text = self.tok.decode(ids)
        m = re.search(r"\[eos:(\d+)\]", text)
        self.waiting.append({"req": req, "out": self.expected(req.max_new_tokens, int(m.group(1)) if m else None),
                             "done": 0, "fail": "[fail]" in text, "slow": "[slow]" in text})
        self.added.append(req.request_id)

    def abort_request(self, request_id: str) -> None:
        self._touch()
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        self.waiting = [w for w in self.waiting if w["req"].request_id != request_id]

    def has_work(self) -> bool:
        self._touch()
        return bool(self.running or self.waiting)

    def free_slots(self) -> int:
        self._touch()
        return self.num_slots - len(self.running)

    def num_waiting(self) -> int:
        self._touch()
        return len(self.waiting)

    def reset(self) -> None:
        self._touch()
        self.resets += 1
        self.running.clear()
        self.waiting.clear()

    def step(self) -> list[StepOutput]:
        self._touch()
        while self.waiting and len(self.running) < self.num_slots:
            w = self.waiting.pop(0)
            self.running[w["req"].request_id] = w
        if not self.running:
            return []
        delay = max([self.step_delay_s] + [0.05 for r in self.running.values() if r["slow"]])
        if delay:
            time.sleep(delay)
        if any(r["fail"] for r in self.running.values()):
            raise RuntimeError("planted engine failure")
        outs = []
        for i, (rid, r) in enumerate(list(self.running.items())):
            k = 1 + (self.steps + i) % 3
            new, reason = [], None
            for t in r["out"][r["done"]:r["done"] + k]:
                new.append(t)
                if t == self.eos or t in r["req"].stop_ids:
                    reason = "stop"
                    break
            r["done"] += len(new)
            if reason is None and r["done"] >= r["req"].max_new_tokens:
                reason = "length"
            if reason is not None:
                del self.running[rid]
                self.finished.append(rid)
            outs.append(StepOutput(rid, new, reason is not None, reason, drafted=3, accepted=len(new) - 1,
                                   accepted_by_pos=[1] * (len(new) - 1)))
        self.steps += 1
        return outs


class ServerThread:
    """A uvicorn server for ``app`` on a free port of 127.0.0.1, in a daemon thread (a context manager)."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

"""Shutting the server down (Ctrl-C) while requests run: those that outlast the grace period get the driver's 503
(a JSON error; mid-stream an error event and ``[DONE]``), not uvicorn's bare 500 after cancelling them; a request
that ends within the grace period completes normally. A second Ctrl-C (a forced quit) gives them the 503 at once."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx

from specpilot.serve.app import Server

from .test_serve import EOS, TOK, make_app
from .serve_fake import FakeBatchEngine


def _serve(app, ctx, grace_s, margin_s=0.5):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(app, ctx, log_level="warning", grace_s=grace_s, margin_s=margin_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.time()
    while not server.started:
        assert time.time() - t0 < 30 and thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _post(url, got, name, body):
    """One completion of ``body``; ``got[name] = (status, text)``, or ``(None, error)`` if the connection failed."""
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", **body}, timeout=30)
        got[name] = (r.status_code, r.text)
    except httpx.HTTPError as e:  # pragma: no cover - reported by the asserts below
        got[name] = (None, repr(e))


def _assert_shut_down(got):
    """The long request got the shutdown's 503; the stream ended with its error event, then ``[DONE]``."""
    status, text = got["long"]
    assert status == 503, (status, text)
    assert "shutting down" in json.loads(text)["error"]["message"]
    status, text = got["stream"]
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text[-300:]
    assert "shutting down" in json.loads(events[-2])["error"]["message"]


def test_requests_held_at_shutdown_get_a_503_and_short_ones_finish():
    eng = FakeBatchEngine(TOK, EOS, num_slots=4, step_delay_s=0.05)  # ~2 tokens / 50 ms: 200 tokens take ~5 s
    ctx, app = make_app(eng)
    # the serve command's margin (1 s): at 0.5 s a loaded 2-core machine (the whole suite's threads) once let
    # uvicorn cancel the held requests (its bare 500) before their 503s were written
    server, thread, url = _serve(app, ctx, grace_s=3.0, margin_s=1.0)
    got = {}
    jobs = [threading.Thread(target=_post, args=(url, got) + a) for a in (("long", {"max_tokens": 200}),
                                                            ("stream", {"max_tokens": 200, "stream": True}),
                                                            ("short", {"max_tokens": 4}))]
    for j in jobs:
        j.start()
    while len(eng.added) < 3:
        time.sleep(0.01)
    server.should_exit = True  # what uvicorn's SIGINT handler does
    for j in jobs:
        j.join(30)
    thread.join(30)
    assert not thread.is_alive()
    status, text = got["short"]
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"
    _assert_shut_down(got)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_a_forced_quit_answers_requests_in_flight_with_a_503_and_logs_no_traceback():
    """A second Ctrl-C (uvicorn's ``force_exit``) skips the grace period: requests still running get the driver's
    503 at once (an error event and ``[DONE]`` mid-stream), and no ``CancelledError`` traceback is logged."""
    eng = FakeBatchEngine(TOK, EOS, num_slots=4, step_delay_s=0.05)
    ctx, app = make_app(eng)
    server, thread, url = _serve(app, ctx, grace_s=60.0)  # only the forced quit can end it within the test
    records = _Records()
    for name in ("uvicorn", "uvicorn.error", "specpilot.serve"):
        logging.getLogger(name).addHandler(records)
    got = {}
    jobs = [threading.Thread(target=_post, args=(url, got) + a) for a in (("long", {"max_tokens": 200}),
                                                            ("stream", {"max_tokens": 200, "stream": True}))]
    try:
        for j in jobs:
            j.start()
        while len(eng.added) < 2:
            time.sleep(0.01)
        server.should_exit = True  # the first Ctrl-C
        time.sleep(0.3)  # uvicorn now waits for the requests
        t0 = time.time()
        server.force_exit = True  # the second
        for j in jobs:
            j.join(30)
        thread.join(30)
        assert not thread.is_alive() and time.time() - t0 < 10
    finally:
        for name in ("uvicorn", "uvicorn.error", "specpilot.serve"):
            logging.getLogger(name).removeHandler(records)
    _assert_shut_down(got)
    log = "\n".join(records.lines)
    assert "Traceback" not in log and "CancelledError" not in log and "Exception in" not in log, log
    assert not ctx.driver.alive()


def test_a_step_slower_than_the_margin_does_not_hold_the_503_back():
    """On a loaded machine one engine step can outlast the shutdown's margin: the held requests still get their 503
    (and the stream its error event and ``[DONE]``) before the grace period ends, not a cancelled 500."""
    eng = FakeBatchEngine(TOK, EOS, num_slots=4, step_delay_s=2.5)
    ctx, app = make_app(eng)
    server, thread, url = _serve(app, ctx, grace_s=2.0)
    got = {}
    bodies = (("long", {"max_tokens": 200}), ("stream", {"max_tokens": 200, "stream": True}))
    jobs = [threading.Thread(target=_post, args=(url, got) + a) for a in bodies]
    for j in jobs:
        j.start()
    while len(eng.added) < 2:
        time.sleep(0.01)
    time.sleep(0.3)  # into a step
    t0 = time.time()
    server.should_exit = True
    for j in jobs:
        j.join(30)
    thread.join(30)
    assert not thread.is_alive() and time.time() - t0 < 5.0
    _assert_shut_down(got)

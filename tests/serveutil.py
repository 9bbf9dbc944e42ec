"""``specpilot serve`` started as a user starts it, for tests: a subprocess on ``--port 0``, its address read from
the line it prints, waited on until ``/health`` answers, stopped with Ctrl-C (SIGINT) at the end."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time

import httpx


@contextlib.contextmanager
def served(args: list[str], env: dict):
    """Run ``specpilot serve --port 0 ARGS`` with ``env``; yields ``(base URL ending in /v1, the startup line)``.
    Fails the test when the server exits or prints no address within 120 s."""
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--port", "0", *args], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line, t0 = "", time.time()
        while "specpilot serve:" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve exited"
            assert time.time() - t0 < 120
        url = re.search(r"at (http://\S+/v1)", line).group(1)
        for _ in range(100):
            try:
                if httpx.get(url[:-3] + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, line
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""Candidate systems that cheat, for the adversarial tests of the controller (§3.3, ANCHORS.md).

Each wraps or subclasses a real engine of the bundled deployment and would look faster, or equal to AR,
to a naive evaluator. ``tests/test_adversarial.py`` checks that the controller rejects every one.
"""

from __future__ import annotations

import threading
import time

import torch

from specpilot.engine.engine import Engine
from specpilot.engine.types import Generation


class Twice:
    """An honest but slow system: does all its work twice (a planted 2x slowdown)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt, n):
        self.engine.generate(list(prompt), n)
        return self.engine.generate(prompt, n)


class Memo:
    """Memoises prompt -> output in a class-level dict (it survives new instances, like a module global)
    and replays it; ``precompute`` fills it at construction (untimed) for prompts it knows in advance."""

    cache: dict = {}
    hits = 0

    def __init__(self, engine, precompute=()):
        self.engine = engine
        for p, n in precompute:
            self.generate(list(p), n)

    def generate(self, prompt, n):
        key = (tuple(prompt), n)
        if key in Memo.cache:
            Memo.hits += 1
            return Generation(tokens=list(Memo.cache[key]), steps=0)
        g = self.engine.generate(prompt, n)
        Memo.cache[key] = list(g.tokens)
        return g


class SuffixMemo(Memo):
    """A smarter replay: looks up any cached prompt that ends the salted prompt (strips the salt)."""

    def generate(self, prompt, n):
        for (p, m), out in Memo.cache.items():
            if m == n and len(p) < len(prompt) and tuple(prompt[-len(p):]) == p:
                Memo.hits += 1
                return Generation(tokens=list(out), steps=0)
        return super().generate(prompt, n)


class Lazy:
    """Returns at once; the real generation runs only when the tokens are read (after a naive timer)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt, n):
        engine = self.engine

        class Tokens:
            def __iter__(self):
                return iter(engine.generate(prompt, n).tokens)

        return Generation(tokens=Tokens(), steps=0)


class Saboteur:
    """Starts a thread at construction that burns CPU in short bursts (holding the GIL) whenever the
    saboteur itself is not generating: the other system's runs slow down, none of it inside B's timer."""

    def __init__(self, engine, stop: threading.Event):
        self.engine, self.stop, self.mine = engine, stop, threading.Event()
        threading.Thread(target=self._spin, name="saboteur", daemon=True).start()

    def _spin(self):
        while not self.stop.is_set():
            if self.mine.is_set():
                time.sleep(0.0005)
                continue
            x = 0
            for i in range(2000):  # a short burst, then a pause: enough to tax A, cheap for the test
                x += i * i
            time.sleep(0.002)

    def generate(self, prompt, n):
        self.mine.set()
        try:
            return self.engine.generate(prompt, n)
        finally:
            self.mine.clear()


class SkipVerify(Engine):
    """Every ``every``-th exact pass reports the drafted chain as the target's argmax: the drafted tokens
    are accepted unverified (the pass still fills the cache). Chain trees only."""

    every = 2

    def _argmax(self, tokens, positions, start, mask, prof):
        out = super()._argmax(tokens, positions, start, mask, prof)
        self.calls = getattr(self, "calls", 0) + 1
        if start > 0 and tokens.numel() > 1 and self.calls % self.every == 0:
            out = torch.cat([tokens[1:], out[-1:]])
        return out


def fp8_logits(logits: torch.Tensor) -> torch.Tensor:
    """Verification in low precision: the exact pass's logits rounded to FP8 (e4m3) before the argmax."""
    return logits.to(torch.float8_e4m3fn).float()


def biased(vocab: int, every: int = 7, bias: float = 1.5):
    """A small logit bias: +``bias`` on every ``every``-th token id (the paper's planted defect, §3.4)."""
    b = torch.zeros(vocab)
    b[torch.arange(0, vocab, every)] = bias
    return lambda logits: logits + b

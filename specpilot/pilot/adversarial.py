"""Candidates that cheat (§3.3, ``../shared/ANCHORS.md``): the controller and token forcing must reject each.

Each wraps or subclasses a real engine and would look faster, or equal to AR, to a naive evaluator.
``tests/test_adversarial.py`` checks every one on the CPU; ``specpilot pilot --adversarial`` judges them
in the run itself, on the run's device, through the same :meth:`Controller.judge` as every real candidate
(:func:`adversaries`), and reports each verdict.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specpilot.config import SystemConfig
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
    are accepted unverified (the pass still fills the cache). Chain trees only; any device."""

    every = 2

    def generate(self, prompt_ids, max_new_tokens, stop_ids=None, prof=None):
        self.calls = 0  # per request, so the cheat is deterministic (a re-run gives the same tokens)
        return super().generate(prompt_ids, max_new_tokens, stop_ids, prof)

    def _verify(self, tok_list, pos_list, start, tree, prof):
        out = super()._verify(tok_list, pos_list, start, tree, prof)
        self.calls = getattr(self, "calls", 0) + 1
        if start > 0 and len(tok_list) > 1 and self.calls % self.every == 0:
            out = torch.cat([torch.tensor(tok_list[1:], device=out.device), out[-1:]])
        return out


def fp8_logits(logits: torch.Tensor) -> torch.Tensor:
    """Verification in low precision: the exact pass's logits rounded to FP8 (e4m3) before the argmax."""
    return logits.to(torch.float8_e4m3fn).float()


def biased(vocab: int, every: int = 7, bias: float = 1.5):
    """A small logit bias: +``bias`` on every ``every``-th token id (the paper's planted defect, §3.4).
    The bias tensor is made on the logits' device at the first (eager) call, so the hook can be captured
    in a CUDA graph afterwards."""
    held: dict = {}

    def hook(logits: torch.Tensor) -> torch.Tensor:
        if logits.device not in held:
            b = torch.zeros(vocab, device=logits.device)
            b[torch.arange(0, vocab, every, device=logits.device)] = bias
            held[logits.device] = b
        return logits + held[logits.device]

    return hook


@dataclass(frozen=True)
class Adversary:
    """One cheating candidate for the pilot's adversarial check.

    Attributes:
        name: short name; cheat: what it does; defence: the controller rule expected to reject it.
        make_a / make_b: factories of the incumbent side (stock, or stock doing its work twice where the
            cheat would otherwise lose on speed alone) and of the cheat.
        reason_has: a phrase the verdict's reason must contain when the expected defence fired.
    """

    name: str
    cheat: str
    defence: str
    make_a: Callable[[], object]
    make_b: Callable[[], object]
    reason_has: str


def adversaries(dep, stock: SystemConfig, stop: threading.Event) -> list[Adversary]:
    """The five kinds of cheat the controller and token forcing must reject (cached outputs, work outside the
    timed region, a logit bias, low-precision verification, skipped verification), each built on ``stock`` of deployment ``dep``
    (a :class:`~specpilot.engine.deployment.Deployment`). ``stop`` ends the saboteur's thread.

    Where a cheat would lose on speed anyway (it does the incumbent's work, plus a defect), A does its
    work twice (a planted 2x slowdown), so only the defence under test can reject it."""
    plain = lambda: dep.system(stock)  # noqa: E731
    slow = lambda: Twice(dep.system(stock))  # noqa: E731
    vocab = dep.target.args.vocab_size

    def skip():
        honest = dep.system(stock)
        return SkipVerify(dep.target, stock, honest.drafter, eos_ids=dep.eos_ids(),
                          buckets=honest.runner is not None)

    Memo.cache.clear()
    return [
        Adversary("cached outputs", "replays outputs memoised from earlier runs (prompt -> tokens)",
                  "fresh salted prompt per timed run", plain, lambda: Memo(dep.system(stock)), "below the bar"),
        Adversary("lazy outputs", "returns at once; generates when the tokens are read",
                  "timer covers reading every token", plain, lambda: Lazy(dep.system(stock)), "below the bar"),
        Adversary("thread left running", "a helper thread taxes the other system between its own runs",
                  "threads alive outside the timed region", plain, lambda: Saboteur(dep.system(stock), stop),
                  "outside the timed region"),
        Adversary("logit bias", "+1.5 on every 7th token id's logit", "token forcing", slow,
                  lambda: dep.system(stock, logits_hook=biased(vocab)), "token forcing failed"),
        Adversary("low-precision verification", "argmax of FP8 (e4m3) logits", "token forcing", slow,
                  lambda: dep.system(stock, logits_hook=fp8_logits), "token forcing failed"),
        Adversary("skipped verification", "every 2nd exact pass accepts the drafted chain unverified",
                  "token forcing", slow, skip, "token forcing failed"),
    ]


def check_adversaries(pilot) -> list[dict]:
    """``pilot --adversarial``: judge A vs A and every cheat of :func:`adversaries` (built on stock) through
    the run's controller and token forcing, as any candidate (§3.3, §3.4), in this process (the cheats are
    objects here, whatever the executor of the real candidates).

    Args:
        pilot: the run's :class:`~specpilot.pilot.state.Pilot` after Phase 0 (``dep``, ``stock``, ``reqs``,
            ``controller``).
    Returns:
        One row each: verdict, reason, and whether the expected defence is what rejected it
        (``defence_fired``).
    """
    stop = threading.Event()
    control = Adversary("A vs A", "stock against itself (a control: never approved)", "approval bar",
                        lambda: pilot.dep.system(pilot.stock), lambda: pilot.dep.system(pilot.stock), "below the bar")
    rows = []
    try:
        for adv in [control] + adversaries(pilot.dep, pilot.stock, stop):
            bar, advance = pilot.progress(f"adversarial: {adv.name}", 4 * len(pilot.reqs))
            with bar:
                j = pilot.controller.judge(adv.make_a, adv.make_b, pilot.reqs, progress=advance)
            v = j.verdict
            fired = (not v.approved) and adv.reason_has in v.reason
            pilot.say("adversarial", ("[green]rejected[/]" if not v.approved else "[red bold]APPROVED[/]")
                      + f" {adv.name}: {v.reason}" + ("" if fired else f" [yellow](expected: {adv.defence})[/]"))
            rows.append({"name": adv.name, "cheat": adv.cheat, "defence": adv.defence, "gain": j.run.gain,
                         "lower_bound": j.run.lower_bound, "bar": v.bar, "outputs_differ": j.run.outputs_differ,
                         "forcing_passed": j.forcing_passed, "forcing_reasons": list(j.forcing_reasons),
                         "approved": v.approved, "reason": v.reason, "defence_fired": fired})
    finally:
        stop.set()
    return rows

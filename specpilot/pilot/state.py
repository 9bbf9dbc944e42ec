"""The state of one pilot run, handed from phase to phase (paper §3).

:class:`Pilot` holds what every phase of :func:`specpilot.pilot.run.run_pilot` shares: the options, the
deployment and its AR / stock configs, where judgements run (:mod:`.dispatch`), the request set, the Phase 0
controller, the planner, and the helpers that build, measure and judge systems. Each phase is a function
of its own module that reads this state and returns its own result:

    phase0.prepare -> phase0.run_phase0 -> costinputs.cost_inputs -> rounds.run_rounds
    -> adversarial.check_adversaries (``--adversarial``) -> seal.seal

**One source of truth for T_AR** (§3.2, :mod:`.steps`): every c = T_step / T_AR is the ratio of two
decode-step times from one interleaved measurement of AR and the system (:meth:`Pilot.measure`).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
import time
from pathlib import Path

import torch
from rich.console import Console

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.errors import SpecPilotError
from specpilot.pilot import controller as ctl
from specpilot.pilot.dispatch import plan_dispatch, stock_commit
from specpilot.pilot.memory import Entry, Evidence
from specpilot.pilot.reuse import open_source
from specpilot.pilot.setup import available_cores, choose_threads
from specpilot.pilot.steps import c_of, interleaved_steps
from specpilot.pilot.workers import DeploymentSpec
from specpilot.provenance import git_commit



@dataclass
class PilotOptions:
    """Options of one pilot run (CLI flags of ``specpilot pilot``)."""

    target: Path
    drafter: Path | None = None
    out: Path = Path("specpilot-report")
    quick: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    overrides: dict | None = None
    blocks: tuple = ()  # block drafter directories the planner may propose (kind, block size, builder)
    eagle3: tuple = ()  # EAGLE-3 drafter directories the planner may propose (top-K, depth, builder)
    adversarial: bool = False  # judge the cheating candidates of :mod:`.adversarial` in this run
    threads: int | None = None  # torch intra-op threads (None: 1 on a CPU device with <= 2 cores, else torch's)
    memory: Path | None = None  # memory directory of an earlier run to start from (§3.5)
    # where judgements run and the external agent (rule: specpilot.pilot.dispatch)
    devices: tuple = ()  # --devices (empty: just --device)
    paired_devices: bool | None = None  # None: two-device paired judgements iff exactly two devices
    executor: str = "auto"  # auto | local | workers
    agent: str | None = None  # command template with {brief} and {worktree}
    agent_timeout: float = 1800.0  # seconds
    scorer_dtype: str | None = None  # token forcing's scorer body: None = the deployment dtype (§3.4), or float32
    calibration: Path | None = None  # a calibration file: the planner may propose the SIMULATED 'calibrated' drafter
    compile_cpu: bool = False  # --batch on the CPU: every batched engine runs the compiled stack (serve --compile's)
    prompts: Path | None = None  # --prompts FILE: the deployment's own requests instead of the bundled benchmarks
    aligned: bool = False  # --aligned: the target's single-request passes on the batched engine's kernels

    @property
    def plan(self) -> dict:
        """Request-set size and search effort as asked: ``--quick`` starts from a smaller plan, which the run
        shrinks further until its estimated duration fits a few minutes (:func:`.budget.size_plan`).

        Keys: per_benchmark, max_new_tokens, rounds, candidates, depth_max, benchmarks (how many of the
        bundled benchmarks, None = all). ``overrides`` replaces any of them (and the run never shrinks those).
        """
        if self.quick:
            plan = {"per_benchmark": 2, "max_new_tokens": 32, "rounds": 1, "candidates": 2, "depth_max": 8}
        else:
            plan = {"per_benchmark": 4, "max_new_tokens": 64, "rounds": 3, "candidates": 3, "depth_max": 10}
        return {**plan, "benchmarks": None, **(self.overrides or {})}


class Pilot:
    """State of one pilot run; the phases fill it in order (module doc).

    Set here: ``t0`` (``time.perf_counter()`` at the start), ``commit`` (the checkout's at the start), ``o`` (options), ``con`` (console), ``dep``
    (:class:`Deployment`), ``stock`` / ``ar`` configs, ``dispatch``, ``source`` (``--memory``), ``threads``;
    ``plan`` (the options' plan until :func:`.phase0.prepare` sizes it). Filled later: ``peaks``, ``reqs``,
    ``duration`` (setup), ``scorer`` and ``controller`` (Phase 0), ``planner`` (cost-model inputs),
    ``c_measured`` (every c measured along the run), ``predictions`` (every screened candidate's predicted and
    live τ and c), ``replay_reqs`` (cost-model inputs: per request, the prompt its lattices were recorded on, the
    first salted variant of Phase 0, with its budget), ``code_tree`` / ``code_entries`` (the incumbent's
    approved agent patches).

    Raises:
        SpecPilotError: ``--memory`` is this run's own output or unusable, ``--threads < 1``, a bad checkpoint
            or drafter (see :class:`Deployment`), or ``--agent`` without a git checkout.
    """

    def __init__(self, opts: "PilotOptions", console: Console | None = None):
        self.t0 = time.perf_counter()  # the run's clock starts before the deployment loads
        self.commit = git_commit()  # the code that runs is the code at the start, whatever is committed later
        self.o, self.con = opts, console or Console(stderr=True, soft_wrap=True)  # piped: no 80-column wrap inside paths
        dev = torch.device(opts.device)
        if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
            torch.cuda.set_device(dev)  # Triton kernels launch on the current device
        if opts.memory is not None and Path(opts.memory).resolve() == (opts.out / "memory").resolve():
            raise SpecPilotError(f"--memory {opts.memory} is this run's own output ({opts.out}/memory), which the run "
                                 "replaces: copy it elsewhere and pass the copy")
        self.source = open_source(opts.memory) if opts.memory is not None else None  # bad --memory: fail first
        try:
            self.threads, self.threads_reason = choose_threads(opts.device, opts.threads, available_cores(),
                                                               torch.get_num_threads())
        except ValueError as e:
            raise SpecPilotError(str(e)) from None
        torch.set_num_threads(self.threads)
        self.dep = Deployment(opts.target, opts.drafter, dtype=opts.dtype, device=opts.device, block_dirs=opts.blocks,
                              aligned=opts.aligned, eagle3_dirs=opts.eagle3)
        self.drafter_kind = "draft_model" if self.dep.draft_model is not None else "ngram"
        self.stock = SystemConfig.stock(self.drafter_kind, depth=6, dtype=opts.dtype)
        self.ar = SystemConfig.ar(dtype=opts.dtype)
        self.engines: dict[str, object] = {}
        spec = DeploymentSpec(str(self.dep.target_dir.resolve()),
                              str(self.dep.drafter_dir.resolve()) if self.dep.drafter_dir else None, opts.dtype,
                              tuple(str(b.resolve()) for b in self.dep.block_dirs), opts.aligned,
                              tuple(str(e.resolve()) for e in self.dep.eagle3_dirs))
        self.dispatch = plan_dispatch(opts.device, opts.devices, opts.paired_devices, opts.executor,
                                      bool(opts.agent), spec, torch.get_num_threads())
        self.code_tree, self.code_entries = None, []  # the incumbent's code: approved agent patches (§3.5)
        if opts.agent:  # fail before Phase 0, not in round 1, when there is no git checkout
            from specpilot.pilot.memory import default_repo

            stock_commit(default_repo())
        self.plan = opts.plan
        self.peaks, self.reqs, self.duration = None, [], {}
        self.scorer, self.controller, self.planner = None, None, None
        self.c_measured: list[dict] = []
        self.predictions: list[dict] = []
        self.replay_reqs: list = []  # set with the planner (cost-model inputs): the recorded prompts, per request
        self.tau_best_source = ""  # where the last ceiling's τ_best came from (:func:`.ceiling.ceiling`)

    # -- Phase 0's facts (§3.3, §3.4) -------------------------------------------------------------
    @property
    def sigma(self) -> float:
        """Stock A/A noise σ (fraction), fixed by Phase 0."""
        return self.controller.sigma

    @property
    def delta(self) -> float:
        """Near-tie threshold δ (nats), fixed by Phase 0."""
        return self.controller.delta

    @property
    def stock_forcing(self):
        """Stock's token-forcing figures (:class:`~specpilot.pilot.forcing.ForcingStats`), from Phase 0."""
        return self.controller.stock_forcing

    # -- helpers of every phase -------------------------------------------------------------------
    def say(self, phase: str, msg: str) -> None:
        """One console line ``phase msg`` (rich markup allowed in ``msg``)."""
        self.con.print(f"[bold cyan]{phase}[/] {msg}")

    def progress(self, label: str, runs: int):
        """A transient progress bar of ``runs`` timed runs; returns (context manager, advance callback)."""
        from rich.progress import Progress

        bar = Progress(console=self.con, transient=True)
        task = bar.add_task(label, total=runs)
        return bar, lambda: bar.advance(task)

    def engine(self, cfg: SystemConfig):
        """The engine of ``cfg`` in this process, built once per config and kept (profiling, screening)."""
        key = cfg.seal()
        if key not in self.engines:
            self.engines[key] = self.dep.system(cfg)
        return self.engines[key]

    def factory(self, cfg: SystemConfig, tree=None):
        """What the controller builds a fresh system of ``cfg`` from (it builds, times and audits it): a
        factory in-process, or a worker spec running ``tree``'s code (None: stock)."""
        return self.dispatch.system(lambda: self.dep.system(cfg), cfg, tree)

    def salt_kw(self) -> dict:
        """The controller's salt range: the target's vocabulary less EOS and the tokenizer's special ids."""
        avoid = set(self.dep.eos_ids()) | set(getattr(self.dep.tokenizer, "all_special_ids", []) or [])
        return {"vocab_size": self.dep.target.args.vocab_size, "avoid_ids": frozenset(avoid)}

    def spread_indices(self, n: int | None) -> list[int]:
        """Indices of ``n`` requests evenly spread over the request set (all of them for None)."""
        idx = list(range(len(self.reqs)))
        return idx if not n else idx[:: max(1, len(idx) // n)][:n]

    def spread(self, n: int | None):
        """``n`` requests evenly spread over the request set (all of them for None), those of :meth:`spread_indices`."""
        return [self.reqs[i] for i in self.spread_indices(n)]

    def measure(self, cfg: SystemConfig, n: int | None = None, reqs=None) -> dict:
        """Decode-step figures of ``cfg`` and AR measured interleaved (AR X X AR per request, the faster run
        of each kept) over ``n`` requests spread over the set (:func:`.steps.interleaved_steps`), or over the
        given ``reqs`` (objects with ``prompt_ids`` and ``max_new_tokens``, e.g. :attr:`replay_reqs`).

        Returns:
            ``{tau, rows, step_ms, steps, ar_step_ms, c}``: ms per decode step (prefill excluded) and
            c = step_ms / ar_step_ms, both from this one measurement (§3.2).
        """
        reqs = self.spread(n) if reqs is None else list(reqs)
        if cfg.seal() == self.ar.seal():
            ar = interleaved_steps({"ar": self.engine(self.ar)}, reqs)["ar"]
            return {**ar.to_dict(), "ar_step_ms": ar.step_ms, "c": 1.0}
        st = interleaved_steps({"ar": self.engine(self.ar), "x": self.engine(cfg)}, reqs)
        return {**st["x"].to_dict(), "ar_step_ms": st["ar"].step_ms, "c": c_of(st["x"], st["ar"])}

    def judge(self, a: SystemConfig, b: SystemConfig, label: str) -> ctl.Judgement:
        """Candidate ``b`` against incumbent ``a`` through the controller (§3.3) and token forcing (§3.4); ``b`` = AR
        is not bound by forcing (:func:`~specpilot.pilot.controller.approve`)."""
        bar, advance = self.progress(f"paired run {label}", 4 * len(self.reqs))
        with bar:
            return self.controller.judge(self.factory(a, self.code_tree), self.factory(b, self.code_tree), self.reqs,
                                         progress=advance, executor=self.dispatch.executor(0),
                                         b_is_ar=b.seal() == self.ar.seal())

    def judge_many(self, a: SystemConfig, cands: list) -> list:
        """Judge every config in ``cands`` against ``a``, concurrently on the device slots (one judgement
        per slot, :mod:`.dispatch`); a :class:`Judgement` or the exception that stopped it, in order."""
        bar, advance = self.progress(f"paired runs ({len(self.dispatch.slots)} at once)", 4 * len(self.reqs) * len(cands))
        fa = self.factory(a, self.code_tree)
        jobs = [lambda ex, b=b: self.controller.judge(fa, self.factory(b, self.code_tree), self.reqs, progress=advance,
                                                      executor=ex) for b in cands]
        with bar:
            return self.dispatch.map(jobs)

    def deployment(self) -> dict:
        """The deployment as the report and the memory entries record it (batch 1)."""
        dep = {"target": str(self.o.target), "drafter": str(self.o.drafter) if self.o.drafter else "ngram",
               "device": self.o.device, "dtype": self.o.dtype, "batch": 1}
        if self.o.calibration is not None:  # every figure of a 'calibrated' system is a simulation of acceptance
            from specpilot.spec.calibration import load_calibration

            q = load_calibration(self.o.calibration).q_agreement is not None  # then its TLV Q agreement is too
            dep["calibration"] = (f"{self.o.calibration} (the calibrated drafter's acceptance"
                                  f"{' and TLV Q-pass agreement are' if q else ' is'} SIMULATED)")
        if self.o.prompts is not None:  # tuned on the deployment's own requests, not the bundled benchmarks
            import hashlib

            h = hashlib.sha256(Path(self.o.prompts).read_bytes()).hexdigest()
            dep["requests"] = f"{self.o.prompts} (sha256 {h[:16]}: the deployment's own, --prompts)"
        return dep

    def entry(self, rnd, incumbent, cand, run, forcing, requires, reused_from: str | None = None) -> Entry:
        """A memory entry for an approved candidate (§3.5): delta relative to the incumbent. ``rnd`` is the
        round number, or ``"reuse"`` for an entry of an earlier memory re-measured here (``reused_from``)."""
        delta = cand.delta(incumbent)
        slug = "-".join(f"{k}-{v}" for k, v in sorted(delta.items())).replace("_", "").lower()[:60]
        slug = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in slug)
        prefix = "reuse" if reused_from else f"r{rnd}"
        return Entry(
            id=f"{prefix}-{slug}", title=("reused: " if reused_from else "") + f"{incumbent.label()} -> {cand.label()}",
            mechanism=cand.tree, reused_from=reused_from,
            requires=list(requires), delta=delta, options={k: getattr(cand, k) for k in ("nodes", "depth", "top_k")},
            evidence=Evidence(gain=run.gain, lower_bound=run.lower_bound, bar=ctl.BASE_BAR + 2 * self.sigma,
                              sigma=self.sigma, forcing=forcing.to_dict(), deployment=self.deployment(),
                              date=_dt.date.today().isoformat()),
            base=self.stock.model_dump(), system=cand.model_dump(),
            limits=["measured on this deployment and device only; re-tune and re-measure on a new one"],
            not_verified=["batching (batch 1 only)", "other dtypes / devices than the one in evidence"],
        )

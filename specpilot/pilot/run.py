"""``specpilot pilot``: the SpecPilot procedure end to end on one device (§3).

Phase 0 measures AR and stock, the stock A/A noise σ and the near-tie threshold δ. Each round then
profiles the incumbent (cost model, ceiling, §3.2), lets the planner propose candidates aimed at the
largest factor, and hands each to the controller and token forcing on one path
(:meth:`specpilot.pilot.controller.Controller.judge`: paired A B B A runs on fresh salted prompts, bootstrap
lower bound, §3.3, §3.4); the controller builds every system itself from a factory. Approved candidates
become memory entries (§3.5); the last incumbent is sealed, re-measured against AR and stock, audited,
reproduced from stock + entries, and reported. With several devices or ``--agent`` the systems run in
worker processes and a round's candidates are judged on all devices at once; the agent is called once
per round after the config candidates (:mod:`specpilot.pilot.dispatch`).
"""

from __future__ import annotations

import datetime as _dt
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from ..config import SystemConfig
from ..engine.deployment import Deployment
from . import controller as ctl
from .costmodel import build_ceiling, step_counts
from .dispatch import AgentContext, agent_round, plan_dispatch, stock_commit
from .forcing import Scorer, audit, forcing_verdict
from .memory import Entry, Evidence, Memory
from .planner import Planner
from .profiler import StepProfiler, measure_peaks
from .replay import record
from .report import write_report
from .setup import build_requests, git_commit, measure_verify_ms, versions
from .workers import DeploymentSpec


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
    blocks: tuple = ()  # issue 3: block drafter directories the planner may propose (kind, block size, builder)
    # issue 6: where judgements run and the external agent (rule: specpilot.pilot.dispatch)
    devices: tuple = ()  # --devices (empty: just --device)
    paired_devices: bool | None = None  # None: two-device paired judgements iff exactly two devices
    executor: str = "auto"  # auto | local | workers
    agent: str | None = None  # command template with {brief} and {worktree}
    agent_timeout: float = 1800.0  # seconds

    @property
    def plan(self) -> dict:
        """Request-set size and search effort: ``--quick`` is a smoke run of a few minutes on 2 cores.

        ``overrides`` replaces any of: per_benchmark, max_new_tokens, rounds, candidates, depth_max.
        """
        if self.quick:
            plan = {"per_benchmark": 2, "max_new_tokens": 32, "rounds": 1, "candidates": 2, "depth_max": 8}
        else:
            plan = {"per_benchmark": 4, "max_new_tokens": 64, "rounds": 3, "candidates": 3, "depth_max": 10}
        return {**plan, **(self.overrides or {})}


class Pilot:
    """State of one pilot run; :meth:`run` does the whole procedure and returns the report dict."""

    def __init__(self, opts: PilotOptions, console: Console | None = None):
        self.o, self.con = opts, console or Console(stderr=True)
        self.dep = Deployment(opts.target, opts.drafter, dtype=opts.dtype, device=opts.device, block_dirs=opts.blocks)
        self.drafter_kind = "draft_model" if self.dep.draft_model is not None else "ngram"
        self.stock = SystemConfig.stock(self.drafter_kind, depth=6, dtype=opts.dtype)
        self.ar = SystemConfig.ar(dtype=opts.dtype)
        self.engines: dict[str, object] = {}
        spec = DeploymentSpec(str(self.dep.target_dir.resolve()),
                              str(self.dep.drafter_dir.resolve()) if self.dep.drafter_dir else None, opts.dtype,
                              tuple(str(b.resolve()) for b in self.dep.block_dirs))
        self.dispatch = plan_dispatch(opts.device, opts.devices, opts.paired_devices, opts.executor,
                                      bool(opts.agent), spec, torch.get_num_threads())
        self.code_tree, self.code_entries = None, []  # the incumbent's code: approved agent patches (§3.5)
        if opts.agent:  # fail before Phase 0, not in round 1, when there is no git checkout
            from .memory import default_repo

            stock_commit(default_repo())

    # -- helpers ---------------------------------------------------------------------------------
    def say(self, phase: str, msg: str) -> None:
        self.con.print(f"[bold cyan]{phase}[/] {msg}")

    def engine(self, cfg: SystemConfig):
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

    def progress(self, label: str, runs: int):
        """A transient progress bar of ``runs`` timed runs; returns (context manager, advance callback)."""
        from rich.progress import Progress

        bar = Progress(console=self.con, transient=True)
        task = bar.add_task(label, total=runs)
        return bar, lambda: bar.advance(task)

    def judge(self, a: SystemConfig, b: SystemConfig, label: str) -> ctl.Judgement:
        """Candidate ``b`` against incumbent ``a`` through the controller (§3.3) and token forcing (§3.4)."""
        bar, advance = self.progress(f"paired run {label}", 4 * len(self.reqs))
        with bar:
            return self.controller.judge(self.factory(a, self.code_tree), self.factory(b, self.code_tree), self.reqs,
                                         progress=advance, executor=self.dispatch.executor(0))

    def judge_many(self, a: SystemConfig, cands: list) -> list:
        """Judge every config in ``cands`` against ``a``, concurrently on the device slots (one judgement
        per slot, :mod:`.dispatch`); a :class:`Judgement` or the exception that stopped it, in order."""
        bar, advance = self.progress(f"paired runs ({len(self.dispatch.slots)} at once)", 4 * len(self.reqs) * len(cands))
        fa = self.factory(a, self.code_tree)
        jobs = [lambda ex, b=b: self.controller.judge(fa, self.factory(b, self.code_tree), self.reqs, progress=advance,
                                                      executor=ex) for b in cands]
        with bar:
            return self.dispatch.map(jobs)

    def spread(self, n: int | None):
        """``n`` requests evenly spread over the request set (all of them for None)."""
        return self.reqs if not n else self.reqs[:: max(1, len(self.reqs) // n)][:n]

    def measure(self, cfg: SystemConfig, n: int | None = None) -> dict:
        """τ, mean rows and ms per step (prefill excluded) of ``cfg`` over ``n`` requests spread over the set."""
        eng, steps, toks, rows, ms = self.engine(cfg), 0, 0, 0, 0.0
        for req in self.spread(n):
            g = min((eng.generate(list(req.prompt_ids), req.max_new_tokens) for _ in range(2)),
                    key=lambda x: x.time_s - x.prefill_s)  # the faster of two runs (interference only adds)
            steps, toks, rows = steps + g.steps, toks + sum(g.accepted), rows + sum(g.rows)
            ms += 1e3 * (g.time_s - g.prefill_s)
        return {"tau": toks / max(steps, 1), "rows": rows / max(steps, 1), "step_ms": ms / max(steps, 1), "steps": steps}

    # -- the procedure ---------------------------------------------------------------------------
    def run(self) -> dict:
        o, plan = self.o, self.o.plan
        torch.manual_seed(o.seed)
        self.say("setup", f"target {o.target}  drafter {o.drafter or 'ngram'}  device {o.device}  dtype {o.dtype}")
        self.peaks = measure_peaks(o.device, self.dep.target.dtype, seconds_budget=1.5)
        self.say("setup", f"peaks: {self.peaks.flops_per_s / 1e9:.1f} GFLOP/s, {self.peaks.bytes_per_s / 1e9:.1f} GB/s")
        context = min(self.dep.target.args.max_position_embeddings, 4096)  # the engine's max_len
        self.reqs = [r for r in build_requests(self.dep, plan["per_benchmark"], plan["max_new_tokens"])
                     if len(r.prompt_ids) + ctl.SALT_TOKENS + r.max_new_tokens <= context]  # room for the salt
        self.say("setup", f"{len(self.reqs)} requests from {sorted({r.benchmark for r in self.reqs})}")

        # Phase 0
        self.say("phase 0", "AR vs stock and stock A/A (paired A B B A on salted prompts)")
        self.scorer = Scorer(self.dep.target)
        bar, advance = self.progress("phase 0 paired runs", 8 * len(self.reqs))
        with bar:
            p0 = ctl.phase0(self.factory(self.ar), self.factory(self.stock), self.reqs, self.scorer,
                            progress=advance, executor=self.dispatch.executor(0), **self.salt_kw())
        ar_stock, aa, self.controller = p0.ar_stock, p0.aa, p0.controller
        self.sigma, self.delta, self.stock_forcing = self.controller.sigma, self.controller.delta, self.controller.stock_forcing
        self.say("phase 0", f"stock {self.stock.label()}: {ar_stock.gain:.3f}x AR (95% lower bound {ar_stock.lower_bound:.3f})")
        self.phase0 = {"stock_vs_ar_gain": ar_stock.gain, "stock_vs_ar_lower_bound": ar_stock.lower_bound,
                       "aa_gain": aa.gain, "aa_lower_bound": aa.lower_bound, "sigma": self.sigma}
        self.say("phase 0", f"stock A/A gain {aa.gain:.4f}: noise σ = {self.sigma:.4f}")
        if self.sigma > 0.05:
            self.say("phase 0", f"[yellow]warning: stock noise σ = {self.sigma:.1%} is high (another busy process?); "
                     f"only gains above {0.01 + 2 * self.sigma:.0%} can be approved in this run[/]")
        self.phase0.update({"delta": self.delta, "stock_forcing": self.stock_forcing.to_dict()})
        self.say("phase 0", f"δ = {self.delta}; stock mismatch rate {self.stock_forcing.mismatch_rate:.3%}, events {self.stock_forcing.events}")
        # replay inputs: the first salted variant of every request and AR's output on it
        prompts = [list(ps[0]) for ps in ar_stock.prompts]
        ar_out = [list(os_[0]) for os_ in ar_stock.outputs_a]

        # cost model inputs: AR step, pass time by rows, lattices for replay
        ar_m = self.measure(self.ar, n=4)
        verify_ms = measure_verify_ms(self.dep.target, prefix_len=200, rows=(1, 2, 4, 8, 16, 24, 32, 48, 64))
        self.c_curve = {r - 1: ms / verify_ms[1] for r, ms in verify_ms.items() if r > 1}
        recs = {}
        depth_max = plan["depth_max"]
        for k in (1, 2, 4, 8):
            recs[("ngram", k)] = record(self.dep.system(SystemConfig(drafter="ngram", top_k=k, depth=depth_max, nodes=depth_max)).drafter,
                                         prompts, ar_out, depth_max, k)
        if self.dep.draft_model is not None:
            self.say("cost model", "recording draft-model lattices along the AR outputs (exact replay)")
            dm = self.dep.system(SystemConfig(drafter="draft_model", top_k=8, depth=depth_max, nodes=depth_max)).drafter
            recs[("draft_model", 8)] = record(dm, prompts, ar_out, depth_max, 8)
        for bd in self.dep.block_dirs:  # issue 3: block drafters, recorded at their full block for replay
            self.say("cost model", f"recording block-drafter lattices of {bd} (exact replay)")
            bdr = self.dep.system(SystemConfig(drafter="block", drafter_path=str(bd), top_k=16)).drafter
            recs[(f"block:{bd}", 16)] = record(bdr, prompts, ar_out, bdr.cfg.block_size, 16, target=self.dep.target)
            recs[(f"block:{bd}", 16)].drafter_path = str(bd)
        self.planner = Planner(recs, verify_ms, ar_m["step_ms"])
        self.tau_curve = self.tau_curves()

        incumbent, entries, candidates, rounds, tried = self.stock, [], [], [], {self.stock.seal()}
        memory = Memory(o.out / "memory")
        if ar_stock.gain < 1.0:  # stock loses to AR: speculation itself is a candidate to switch off (§3.3)
            self.say("round 0", f"stock is {ar_stock.gain:.3f}x AR: candidate AR (no drafter) against stock")
            incumbent = self.round0_ar(memory, entries, candidates, tried)
        for rnd in range(1, plan["rounds"] + 1):
            ceil, inc_m = self.ceiling(incumbent, ar_m["step_ms"])
            f = ceil.factors()
            order = sorted(f, key=f.get, reverse=True)
            self.say(f"round {rnd}", "ceiling " + ", ".join(f"{k} {v:.2f}" for k, v in f.items()) + f"  (largest: {order[0]})")
            proposals, attacked = [], order[0]
            for direction in order:
                proposals = self.planner.propose(incumbent, direction, tried, plan["candidates"])
                proposals = self.screen(proposals, inc_m, ar_m["step_ms"], plan["candidates"])
                if proposals:
                    attacked = direction
                    break
                why = ("no kernel mechanism is registered in this build" if direction == "kernel"
                       else "no untried candidate is predicted to beat the incumbent")
                self.say(f"round {rnd}", f"{direction}: {why}; next factor")
            rounds.append({"round": rnd, "ceiling": f, "attacked": attacked, "incumbent": incumbent.label(),
                           "tau": inc_m["tau"], "c": inc_m["step_ms"] / ar_m["step_ms"],
                           "tokens_per_s": 1e3 * inc_m["tau"] / inc_m["step_ms"], "detail": ceil.to_dict()})
            best = None
            for i, (cand, pred) in enumerate(proposals, 1):
                tried.add(cand.seal())
                self.say(f"round {rnd}", f"candidate {i}/{len(proposals)}: {cand.label()} (replay τ {pred.tau:.2f}, "
                         f"screened c {pred.c_screened:.2f}: {pred.speedup_screened:.2f}x AR predicted)")
            judged = self.judge_many(incumbent, [c for c, _ in proposals])
            for (cand, pred), j in zip(proposals, judged):
                if isinstance(j, Exception):  # a worker died or could not build it: rejected, go on
                    reason = f"rejected: {str(j).splitlines()[0] if str(j) else type(j).__name__}"
                    self.say(f"round {rnd}", f"[red]{cand.label()}: {reason}[/]")
                    candidates.append({"round": rnd, "name": cand.label(), "config": cand.model_dump(),
                                       "predicted": pred.to_dict(), "approved": False, "reason": reason})
                    continue
                run, forcing, passed, reasons, v = j.run, j.forcing, j.forcing_passed, list(j.forcing_reasons), j.verdict
                self.say(f"round {rnd}", f"{cand.label()}: " + ("[green]" if v.approved else "[red]") + v.reason + "[/]")
                row = {"round": rnd, "name": cand.label(), "config": cand.model_dump(), "predicted": pred.to_dict(),
                       "gain": run.gain, "lower_bound": run.lower_bound, "bar": v.bar, "outputs_differ": run.outputs_differ,
                       "forcing_passed": passed, "forcing_reasons": reasons, "mismatch_rate": forcing.mismatch_rate,
                       "approved": v.approved, "reason": v.reason}
                candidates.append(row)
                if v.approved and (best is None or run.lower_bound > best[1].lower_bound):
                    best = (cand, run, forcing, row)
            if best is not None:
                cand, run, forcing, row = best
                entry = self.entry(rnd, incumbent, cand, run, forcing, [e.id for e in entries])
                memory.add(entry, overwrite=True)
                entries.append(entry)
                row["entry"] = entry.id
                self.say(f"round {rnd}", f"approved {entry.id}: {incumbent.label()} -> {cand.label()}")
                incumbent = cand
            rounds[-1]["approved"] = best[3]["name"] if best else None
            if o.agent:  # after the round's config candidates (see specpilot.pilot.dispatch)
                self.agent_round(rnd, incumbent, ceil, entries, memory, candidates)
                if self.code_entries and self.code_entries[-1].id == f"r{rnd}-agent-patch":
                    rounds[-1]["approved_patch"] = self.code_entries[-1].id
        return self.seal(incumbent, entries, memory, candidates, rounds, ar_m)

    def agent_round(self, rnd: int, incumbent: SystemConfig, ceil, entries: list, memory, candidates: list) -> None:
        """Call the external agent on the incumbent and judge its patch (:func:`.dispatch.agent_round`);
        approved, it becomes a ``patch`` memory entry and the incumbent's code."""
        from .memory import default_repo

        repo = default_repo()
        commit, dirty = stock_commit(repo)
        if dirty:
            self.say(f"round {rnd}", "[yellow]warning: tracked files under specpilot/ differ from HEAD: the agent's "
                     "tree starts from HEAD, stock workers run the files on disk[/]")
        f = ceil.factors()
        brief = {"cost_model": {"factors": f, "detail": ceil.to_dict()}, "gap": math.prod(f.values()),
                 "memory": [f"{e.id}: {e.title} (gain {e.evidence.gain:.3f})" for e in entries]}
        ctx = AgentContext(self.o.agent, self.o.agent_timeout, (self.o.out / "agent" / f"round-{rnd}").resolve(), repo,
                           commit, list(self.code_entries), [e.id for e in entries], incumbent, self.code_tree,
                           self.controller, self.reqs, self.sigma, brief, self.deployment())
        self.say(f"round {rnd}", f"agent: {self.o.agent}")
        bar, advance = self.progress("paired run agent patch", 4 * len(self.reqs))
        with bar:
            res = agent_round(rnd, ctx, self.dispatch, advance, _dt.date.today().isoformat())
        candidates.append(res.row)
        self.say(f"round {rnd}", "agent patch: " + ("[green]" if res.row["approved"] else "[red]") + res.row["reason"] + "[/]")
        if res.entry is not None:
            memory.add(res.entry, overwrite=True)
            entries.append(res.entry)
            self.code_entries.append(res.entry)
            self.code_tree = str(res.patch.worktree)
            self.say(f"round {rnd}", f"approved {res.entry.id}: the incumbent now runs {res.patch.worktree}")

    def round0_ar(self, memory, entries, candidates, tried) -> SystemConfig:
        """Judge AR (no drafter) against stock like any candidate; approved, it becomes the incumbent (and a
        memory entry), so no later candidate is approved unless it beats AR. Returns the incumbent."""
        tried.add(self.ar.seal())
        j = self.judge(self.stock, self.ar, self.ar.label())
        v = j.verdict
        self.say("round 0", ("[green]" if v.approved else "[red]") + v.reason + "[/]")
        row = {"round": 0, "name": self.ar.label(), "config": self.ar.model_dump(), "predicted": None,
               "gain": j.run.gain, "lower_bound": j.run.lower_bound, "bar": v.bar, "outputs_differ": j.run.outputs_differ,
               "forcing_passed": j.forcing_passed, "forcing_reasons": list(j.forcing_reasons),
               "mismatch_rate": j.forcing.mismatch_rate, "approved": v.approved, "reason": v.reason}
        candidates.append(row)
        if not v.approved:
            return self.stock
        entry = self.entry(0, self.stock, self.ar, j.run, j.forcing, [])
        memory.add(entry, overwrite=True)
        entries.append(entry)
        row["entry"] = entry.id
        self.say("round 0", f"approved {entry.id}: {self.stock.label()} -> {self.ar.label()}")
        return self.ar

    def screen(self, proposals, inc_m: dict, ar_ms: float, k: int):
        """Time each proposal's decode steps live on a few requests (c); keep the ``k`` whose replay τ / c
        beats the incumbent's measured τ / c. The cost model's c misses per-step overheads that only a
        live step shows; the controller still decides."""
        inc = inc_m["tau"] * ar_ms / inc_m["step_ms"]
        kept = []
        for cfg, pred in proposals:
            m = self.measure(cfg, n=3)
            pred.c_screened = m["step_ms"] / ar_ms
            pred.speedup_screened = pred.tau / pred.c_screened
            if pred.speedup_screened > inc:
                kept.append((cfg, pred))
        kept.sort(key=lambda cp: -cp[1].speedup_screened)
        return kept[:k]

    def tau_curves(self) -> dict:
        """τ vs N by exact replay, per tree builder, for the deployment's drafter (report plot)."""
        out = {}
        kind = self.drafter_kind
        k = 8 if kind == "draft_model" else 4
        depth = self.o.plan["depth_max"]
        for builder in ("chain", "best_first", "oracle"):
            curve = {}
            for n in (1, 2, 4, 6, 8, 12, 16, 24, 32):
                if builder == "chain" and n > depth:
                    continue
                cfg = SystemConfig(drafter=kind, tree="chain" if builder == "chain" else "best_first", nodes=n,
                                   depth=min(n, depth) if builder == "chain" else depth, top_k=1 if builder == "chain" else k)
                if builder == "oracle":
                    curve[n] = self.planner.oracle_tau(cfg)
                else:
                    p = self.planner.predict(cfg)
                    curve[n] = p.tau if p else None
            out[f"{kind}/{builder}"] = curve
        return out

    def ceiling(self, cfg: SystemConfig, ar_ms: float):
        """Profile ``cfg``'s decode steps by kernel class and assemble its ceiling (§3.2)."""
        m = self.measure(cfg, n=4)
        eng, prof = self.engine(cfg), StepProfiler(self.o.device)
        steps, prefix = 0, []
        for req in self.spread(4):  # the same requests as the unprofiled step time above
            g = eng.generate(list(req.prompt_ids), req.max_new_tokens, prof=prof)
            steps += g.steps
            prefix.append(len(req.prompt_ids) + len(g.tokens) // 2)
        totals = prof.calibrated_totals_ms()  # less the profiler's own per-region cost
        if "exact_pass" in totals:  # one graph replay per step: split by the pass's kernel classes
            exact = totals.pop("exact_pass")
            if self.dep.target.device.type == "cuda":
                from .kernel_profile import pass_class_fractions

                rows = min(max(1, round(m["rows"])), 256)
                fractions = pass_class_fractions(self.dep.target, rows, int(sum(prefix) / len(prefix)))
            else:
                fractions = {"other": 1.0}
            for k, f in fractions.items():
                totals[k] = totals.get(k, 0.0) + exact * f
        d_args = self.dep.draft_model.args if cfg.drafter == "draft_model" else None
        counts = step_counts(self.dep.target.args, max(1, round(m["rows"])), int(sum(prefix) / len(prefix)),
                             self.dep.target.dtype.itemsize, drafter_args=d_args, drafter_passes=cfg.depth)
        tau_best = max(self.planner.oracle_tau(cfg), m["tau"])
        ceil = build_ceiling(totals, counts, self.peaks, m["step_ms"], m["tau"], tau_best, steps=max(steps, 1),
                             ar_ms=ar_ms, rows=round(m["rows"]))
        return ceil, m

    def entry(self, rnd, incumbent, cand, run, forcing, requires) -> Entry:
        """A memory entry for an approved candidate (§3.5): delta relative to the incumbent."""
        delta = cand.delta(incumbent)
        slug = "-".join(f"{k}-{v}" for k, v in sorted(delta.items())).replace("_", "").lower()[:60]
        return Entry(
            id=f"r{rnd}-{slug}", title=f"{incumbent.label()} -> {cand.label()}", mechanism=cand.tree,
            requires=list(requires), delta=delta, options={k: getattr(cand, k) for k in ("nodes", "depth", "top_k")},
            evidence=Evidence(gain=run.gain, lower_bound=run.lower_bound, bar=ctl.BASE_BAR + 2 * self.sigma,
                              sigma=self.sigma, forcing=forcing.to_dict(), deployment=self.deployment(),
                              date=_dt.date.today().isoformat()),
            base=self.stock.model_dump(), system=cand.model_dump(),
            limits=["measured on this deployment and device only; re-tune and re-measure on a new one"],
            not_verified=["batching (batch 1 only)", "other dtypes / devices than the one in evidence"],
        )

    def deployment(self) -> dict:
        return {"target": str(self.o.target), "drafter": str(self.o.drafter) if self.o.drafter else "ngram",
                "device": self.o.device, "dtype": self.o.dtype, "batch": 1}

    def seal(self, sealed, entries, memory, candidates, rounds, ar_m) -> dict:
        """Seal the final system, re-measure it against AR and stock, audit it and write the report."""
        o = self.o
        o.out.mkdir(parents=True, exist_ok=True)
        self.say("seal", f"sealed system {sealed.label()} ({sealed.seal()[:12]})")
        bar, advance = self.progress("AR, stock, sealed interleaved", 6 * len(self.reqs))
        with bar:
            makers = {"ar": self.factory(self.ar), "stock": self.factory(self.stock),
                      "sealed": self.factory(sealed, self.code_tree)}
            final = ctl.interleaved_run(makers, self.reqs, progress=advance, executor=self.dispatch.executor(0),
                                        **self.salt_kw())
        vs_ar = final.gain("ar", "sealed")
        vs_stock = final.gain("stock", "sealed")
        outputs = final.samples("sealed")
        forcing = audit(self.scorer, outputs, self.delta)
        passed, reasons = forcing_verdict(forcing, self.stock_forcing)
        check = memory.check_all(self.stock, sealed, [e.id for e in entries])
        self.say("seal", f"{vs_ar[0]:.3f}x AR (lower bound {vs_ar[1]:.3f}), {vs_stock[0]:.3f}x stock "
                 f"(lower bound {vs_stock[1]:.3f}); token forcing {'passed' if passed else 'FAILED'}; "
                 f"reproduction check {'ok' if check.ok else 'FAILED'}")
        ceil, _ = self.ceiling(sealed, ar_m["step_ms"])
        m = self.measure(sealed)  # τ and step time over the whole request set
        system = {"config": sealed.model_dump(), "label": sealed.label(), "seal": sealed.seal(),
                  "entries": [e.id for e in entries], "deployment": self.deployment(),
                  "commit": git_commit(), "date": _dt.datetime.now().isoformat(timespec="seconds")}
        report = {
            "device": {"type": o.device, "name": self.peaks.device_name, "threads": torch.get_num_threads(),
                       "platform": platform.platform(), "peaks": self.peaks.to_dict()},
            "versions": versions(), "commit": system["commit"], "deployment": self.deployment(),
            "requests": len(self.reqs), "max_new_tokens": o.plan["max_new_tokens"], "quick": o.quick,
            "ar_tokens_per_s": final.tokens_per_s("ar"), "stock_tokens_per_s": final.tokens_per_s("stock"),
            "sealed_tokens_per_s": final.tokens_per_s("sealed"),
            "speedup_vs_ar": vs_ar[0], "speedup_ci_low": vs_ar[1],
            "speedup_vs_stock": vs_stock[0], "speedup_vs_stock_ci_low": vs_stock[1],
            "headline_method": "AR, stock and sealed interleaved per request on two fresh salted variants "
                               "(A S X on one, X S A on the other), a request's tokens/s the higher of its two runs; "
                               "tokens/s = geometric mean over benchmarks of per-request tokens/s",
            "headline_flags": {"threads_left_running": final.outside, "nondeterministic": final.nondeterministic},
            "phase0": self.phase0,
            "sealed_label": sealed.label(), "sealed_seal": sealed.seal(), "stock_label": self.stock.label(),
            "tau": m["tau"], "c": m["step_ms"] / ar_m["step_ms"], "ar_step_ms": ar_m["step_ms"], "step_ms": m["step_ms"],
            "rows": m["rows"], "ceiling": {**ceil.factors(), "value": ceil.ceiling, "detail": ceil.to_dict()},
            "sigma": self.sigma,
            "token_forcing": {**forcing.to_dict(), "stock_mismatch_rate": self.stock_forcing.mismatch_rate,
                              "stock_event_rate": self.stock_forcing.event_rate, "stock_events": self.stock_forcing.events,
                              "passed": passed, "reasons": reasons},
            "reproduction_check": {"entries": check.entries, "sealed": check.sealed, "ok": check.ok},
            "entries": [{"id": e.id, "title": e.title, "gain": e.evidence.gain, "lower_bound": e.evidence.lower_bound,
                         "requires": e.requires, "delta": e.delta} for e in entries],
            "candidates": candidates, "rounds": rounds, "tau_curve": self.tau_curve, "c_curve": self.c_curve,
        }
        write_report(o.out, report)
        (o.out / "system.json").write_text(__import__("json").dumps(system, indent=2))
        self.say("done", f"report in {o.out}/report.md")
        return report


def run_pilot(opts: PilotOptions) -> dict:
    """Run the pilot and write the report directory; returns the report dict.

    Raises:
        SpecPilotError: bad checkpoint directories or drafter (see :class:`Deployment`).
    """
    return Pilot(opts).run()

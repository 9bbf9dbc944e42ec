"""The cost model's inputs (paper §3.2): T_AR, pass time by rows, and lattices recorded for exact replay.

After Phase 0 the pilot measures AR interleaved with stock (one source of truth for T_AR, :mod:`.steps`),
the exact pass's time by row count right after (again with each block drafter's target layers gathered), the
time to move an accepted path into place, and records every drafter's lattices along AR's outputs
(n-gram at top-1/2/4/8, the draft model, each block drafter at its full block, each EAGLE-3 drafter at each of the
planner's top-K) so the planner can replay
any tree over them (§2.4). From these it builds the :class:`~specpilot.pilot.planner.Planner` and the
report's c(N) and τ(N) curves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specpilot.config import SystemConfig
from specpilot.errors import SpecPilotError
from specpilot.head.cpu import worth as cpu_head_worth
from specpilot.pilot.phase0 import Phase0Result
from specpilot.pilot.planner import EAGLE3_TOP_K, VERIFY_ROWS, Planner
from specpilot.pilot.replay import Recording, record
from specpilot.pilot.replay_tlv import QRecording, record_q
from specpilot.pilot.tlv_cost import TlvInputs
from specpilot.spec.calibrated import SEED
from specpilot.spec.calibrated_q import QSimulation, is_simulated, q_simulation_note, simulated_chains
from specpilot.spec.calibration import load_calibration
from specpilot.pilot.setup import measure_move_ms, measure_verify_ms
from specpilot.pilot.state import Pilot



@dataclass
class CostInputs:
    """The report's ``cost_inputs`` (T_AR, stock's step figures, pass ms by rows, source), ``c_curve``
    (``{N: c}``) and ``tau_curve`` (``{drafter/builder: {N: τ}}``)."""

    report: dict
    c_curve: dict
    tau_curve: dict


def cost_inputs(pilot: Pilot, p0: Phase0Result) -> CostInputs:
    """Measure T_AR and stock's step, pass time by rows, record the drafters' lattices along AR's Phase 0
    outputs, and set ``pilot.planner`` (§3.2). Appends stock's measured c to ``pilot.c_measured``."""
    dep, depth_max = pilot.dep, pilot.plan["depth_max"]
    pilot.replay_reqs = recorded_requests(pilot.reqs, p0)
    calib = pilot.spread_indices(4)  # live steps on the recorded prompts of these requests, replayed over the same
    calib_reqs = [pilot.replay_reqs[i] for i in calib]
    base_m = pilot.measure(pilot.stock, reqs=calib_reqs)
    static = torch.device(dep.device).type == "cuda"  # as the engine runs there
    verify_ms = measure_verify_ms(dep.target, prefix_len=200, rows=VERIFY_ROWS, static=static)
    move_ms = {(): measure_move_ms(dep.target, prefix_len=200)}  # a tree's accepted path out of place
    w12_ms = None  # the W12 pass by rows where the kernel mechanisms apply (GPU, bf16): W12 wins at one row only
    if pilot.stock.dtype == "bfloat16" and static:
        w12_ms = measure_verify_ms(dep.w12_target(), prefix_len=200, rows=VERIFY_ROWS, static=static)
    report = {"ar_step_ms": base_m["ar_step_ms"], "stock": base_m, "verify_ms": verify_ms, "verify_ms_w12": w12_ms,
              "source": "AR and stock interleaved on the recorded (salted) prompts of 4 requests (decode steps, prefill "
                        "excluded); pass times by rows measured right after"}
    pilot.c_measured.append({"label": f"stock {pilot.stock.label()}", "N": base_m["rows"] - 1, "c": base_m["c"],
                             "source": "cost-model inputs"})
    prompts, ar_out = p0.prompts, p0.ar_outputs
    budgets = [r.max_new_tokens for r in pilot.reqs]
    recs, feature_verify, layers = {}, {}, set()
    for k in (1, 2, 4, 8):
        ngram = dep.system(SystemConfig(drafter="ngram", top_k=k, depth=depth_max, nodes=depth_max)).drafter
        recs[("ngram", k)] = record(ngram, prompts, ar_out, depth_max, k, max_new_tokens=budgets)
    if dep.draft_model is not None:
        pilot.say("cost model", "recording draft-model lattices along the AR outputs (exact replay)")
        dm = dep.system(SystemConfig(drafter="draft_model", top_k=8, depth=depth_max, nodes=depth_max)).drafter
        recs[("draft_model", 8)] = record(dm, prompts, ar_out, depth_max, 8, max_new_tokens=budgets)
    for bd in dep.block_dirs:  # block drafters (--block), recorded at their full block for replay
        pilot.say("cost model", f"recording block-drafter lattices of {bd} (exact replay)")
        bdr = dep.system(SystemConfig(drafter="block", drafter_path=str(bd), top_k=16)).drafter
        recs[(f"block:{bd}", 16)] = record(bdr, prompts, ar_out, bdr.cfg.block_size, 16, target=dep.target,
                                           max_new_tokens=budgets)
        recs[(f"block:{bd}", 16)].drafter_path = str(bd)
        layers.add(tuple(bdr.target_layers))
    for ed in dep.eagle3_dirs:  # EAGLE-3 drafters (--eagle3): one recording per top-K (planner.EAGLE3_TOP_K)
        pilot.say("cost model", f"recording EAGLE-3 lattices of {ed} at top-{'/'.join(map(str, EAGLE3_TOP_K))} "
                                "(exact replay)")
        for k in EAGLE3_TOP_K:
            edr = dep.system(SystemConfig(drafter="eagle3", drafter_path=str(ed), top_k=k, depth=depth_max,
                                          nodes=depth_max)).drafter
            recs[(f"eagle3:{ed}", k)] = record(edr, prompts, ar_out, depth_max, k, target=dep.target,
                                               max_new_tokens=budgets)
            recs[(f"eagle3:{ed}", k)].drafter_path = str(ed)
        layers.add(tuple(edr.target_layers))
    for lay in sorted(layers):  # a learned drafter's exact pass also gathers these layers' outputs for it
        feature_verify[lay] = measure_verify_ms(dep.target, prefix_len=200, rows=VERIFY_ROWS, static=static,
                                                feature_layers=lay)
        move_ms[lay] = measure_move_ms(dep.target, prefix_len=200, feature_layers=lay)
    if pilot.o.calibration is not None:  # SIMULATED acceptance (the calibrated drafter), told Phase 0's AR outputs
        pilot.say("cost model", f"recording the calibrated drafter of {pilot.o.calibration} (simulated acceptance)")
        key, rec = record_calibrated(dep, pilot.o.calibration, prompts, ar_out, budgets)
        recs[key] = rec
    report["verify_ms_with_features"] = {",".join(map(str, k)): v for k, v in feature_verify.items()}
    report["move_ms"] = {",".join(map(str, k)): v for k, v in move_ms.items()}
    tlv = tlv_inputs(pilot, recs, max([depth_max] + [r.depth for r in recs.values()]), static)
    report["tlv"] = None if tlv is None else {"weights": tlv.weights, "q_verify_ms": tlv.q_ms,
                                              "agreement": tlv.agreement}
    if tlv is not None and tlv.simulated is not None:  # the calibrated drafter's TLV: its Q agreement is SIMULATED
        report["tlv"].update(simulated_agreement=tlv.simulated_agreement, simulated_path=tlv.simulated_path,
                             simulated=q_simulation_note(load_calibration(tlv.simulated_path)))
    kind_steps = []
    if pilot.stock.drafter != "ngram":  # the step's own work, calibrated where all the drafting is timed host work
        ngram_cfg = SystemConfig.stock("ngram", depth=pilot.stock.depth, dtype=pilot.stock.dtype)
        ng_m = pilot.measure(ngram_cfg, reqs=calib_reqs)
        kind_steps.append((ngram_cfg, ng_m["step_ms"]))
        report["ngram_stock"] = ng_m
    pilot.planner = Planner(recs, verify_ms, base_m["ar_step_ms"], device=pilot.o.device,
                            spec_step=(pilot.stock, base_m["step_ms"]), feature_verify_ms=feature_verify,
                            move_ms=move_ms, kind_steps=kind_steps, calib_requests=calib, tlv=tlv,
                            w12_verify_ms=w12_ms, cpu_head=cpu_head_worth(pilot.dep.target.lm_head.weight))
    report["spec_overhead_ms"] = pilot.planner.overhead_ms
    report["spec_overhead_by_kind_ms"] = dict(pilot.planner.kind_overhead)
    report["spec_overhead_source"] = pilot.planner.spec_overhead_source
    return CostInputs(report, c_model_curve(pilot.planner, verify_ms), tau_curves(pilot))


def record_calibrated(dep, path, prompts, ar_out, budgets) -> tuple[tuple[str, int], Recording]:
    """The calibrated drafter of the calibration file ``path`` recorded along ``ar_out`` (which its deployment's
    continuations are told first), at the calibration's depth and top-K: ``(("calibrated", K), recording)`` with the
    recording's ``drafter_path`` the file. The target goes with it: a block network as cost drafter reads its features."""
    cal = load_calibration(path)
    for p, out in zip(prompts, ar_out):
        dep.continuations.add(p, out)
    cdr = dep.system(SystemConfig(drafter="calibrated", drafter_path=str(path), top_k=cal.top_k, depth=cal.depth,
                                  nodes=cal.depth)).drafter
    rec = record(cdr, prompts, ar_out, cal.depth, cal.top_k, max_new_tokens=budgets, target=dep.target)
    rec.drafter_path = str(path)
    return ("calibrated", cal.top_k), rec


def recorded_requests(reqs: list, p0: Phase0Result) -> list:
    """Per request of ``reqs``, the request the lattices are recorded on: its prompt is Phase 0's first salted
    variant (``p0.prompts``, along which AR's outputs ``p0.ar_outputs`` were made), its budget its own. The
    pilot's screening measures these (:func:`~specpilot.pilot.rounds.screen`), so that a candidate's live τ and c
    are over exactly the prompts its replayed τ and predicted c are.

    Raises:
        ValueError: ``p0`` holds another number of prompts or outputs than ``reqs``.
    """
    if not len(p0.prompts) == len(p0.ar_outputs) == len(reqs):
        raise ValueError(f"phase 0 recorded {len(p0.prompts)} prompts and {len(p0.ar_outputs)} outputs for "
                         f"{len(reqs)} requests")
    return [replace(r, prompt_ids=tuple(int(t) for t in p)) for r, p in zip(reqs, p0.prompts)]


def tlv_inputs(pilot: Pilot, recs: dict, depth: int, static: bool) -> TlvInputs | None:
    """What the planner prices TLV with (§4.3): the Q pass of the target's 8-bit view (``view8``; the bf16 rounding
    of a float32 target) recorded along the AR outputs the recordings hold, ``depth`` chain rows past each root, and
    the Q pass's time by rows, measured as the exact pass's (:func:`measure_verify_ms`). With a calibration that
    measured the real pair's Q agreement (``--calibration``), also the calibrated drafter's SIMULATED Q chains
    (:func:`~specpilot.spec.calibrated_q.simulated_chains`, the draws of the engine's simulated Q pass). None (said,
    and TLV is neither priced nor proposed) for a target without a Q view (:func:`~specpilot.model.qview.q_view` refuses it: a hybrid
    target)."""
    dep = pilot.dep
    try:
        q = dep.q_target(dep.target, "view8")  # the Q view the TLV systems' engines share
    except SpecPilotError as e:
        pilot.say("cost model", f"TLV not priced: {e}")
        return None
    pilot.say("cost model", "recording the Q pass (8-bit view) along the AR outputs (TLV replay)")
    rec = next(iter(recs.values()))
    qrec = record_q(dep.target, q, rec, depth, "view8")
    q_ms = measure_verify_ms(q, prefix_len=200, rows=VERIFY_ROWS, static=static)
    out = TlvInputs(qrec, q_ms, "view8", qrec.agreement(rec))
    cal = load_calibration(pilot.o.calibration) if pilot.o.calibration is not None else None
    if cal is not None and is_simulated(cal, "view8"):  # the chains the engine's SimulatedQPass answers, same draws
        pilot.say("cost model", "the calibrated drafter's Q agreement (TLV) is SIMULATED from its calibration")
        sim = QSimulation(cal.q_agreement, dep.target.args.vocab_size, SEED)
        out.simulated = QRecording(simulated_chains(rec.prompts, rec.ar, sim, depth), depth, "view8")
        out.simulated_path, out.simulated_agreement = str(pilot.o.calibration), out.simulated.agreement(rec)
    return out


def c_model_curve(planner: Planner, verify_ms: dict) -> dict:
    """c(N) of the cost model without drafting: ``(T_spec + T_pass(N+1)) / T_AR`` for N ≥ 1 (the planner's
    step cost, monotone in N), c(0) = 1 (AR itself)."""
    return {0: 1.0, **{r - 1: planner.step_c(r) for r in sorted(verify_ms) if r > 1}}


def tau_curves(pilot: Pilot, kind: str | None = None, path: str | None = None, top_k: int | None = None) -> dict:
    """τ vs N by exact replay, per tree builder, for drafter ``kind`` (``ngram``, ``draft_model``, or ``eagle3`` with
    its checkpoint ``path`` and recorded ``top_k``; default the deployment's; the seal adds the sealed system's when
    it differs) for the report plot."""
    out = {}
    kind = kind or pilot.drafter_kind
    k = top_k or (8 if kind == "draft_model" else 4)
    depth = pilot.plan["depth_max"]
    for builder in ("chain", "best_first", "oracle"):
        curve = {}
        for n in (1, 2, 4, 6, 8, 12, 16, 24, 32):
            if builder == "chain" and n > depth:
                continue
            cfg = SystemConfig(drafter=kind, drafter_path=path, tree="chain" if builder == "chain" else "best_first",
                               nodes=n, depth=min(n, depth) if builder == "chain" else depth,
                               top_k=k if builder != "chain" or kind == "eagle3" else 1)  # eagle3: its recorded K
            if builder == "oracle":
                curve[n] = pilot.planner.oracle_tau(cfg)
            else:
                p = pilot.planner.predict(cfg)
                curve[n] = p.tau if p else None
        out[f"{kind}/{builder}"] = curve
    return out

"""``specpilot pilot``: the SpecPilot procedure end to end on one deployment (paper §3).

One run, phase by phase, each in its own module, sharing a :class:`~specpilot.pilot.state.Pilot`:

1. **setup** (:func:`.phase0.prepare`): device peaks, step times measured right after loading, the plan
   (``--quick`` sized to fit a few minutes, :mod:`.budget`), the request set, the expected duration.
2. **Phase 0** (:func:`.phase0.run_phase0`): AR vs stock and stock A/A: stock noise σ, near-tie δ, stock's
   token-forcing figures (§3.3, §3.4).
3. **cost-model inputs** (:func:`.costinputs.cost_inputs`): T_AR, pass time by rows, drafter lattices for
   exact replay, the planner (§3.2).
4. **rounds** (:func:`.rounds.run_rounds`): ``--memory`` reuse (§3.5), round 0 (AR when stock loses), then
   per round the incumbent's ceiling, the planner's candidates on the largest factor, live screening,
   judgement by the controller and token forcing, the best approval as a memory entry; ``--agent`` once
   per round (:mod:`.dispatch`).
5. **adversarial** (``--adversarial``, :func:`.adversarial.check_adversaries`): the cheats, each rejected.
6. **seal** (:func:`.seal.seal`): the final system re-measured against AR and stock, audited, reproduced
   from stock + entries, and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.pilot.adversarial import check_adversaries
from specpilot.pilot.budget import mark
from specpilot.pilot.costinputs import cost_inputs
from specpilot.pilot.phase0 import clear_old_memory, prepare, run_phase0
from specpilot.pilot.rounds import run_rounds
from specpilot.pilot.seal import seal
from specpilot.pilot.state import Pilot


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


def run_pilot(opts: PilotOptions) -> dict:
    """Run the pilot and write the report directory (module doc); returns the report dict.

    Raises:
        SpecPilotError: bad checkpoint directories or drafter (see :class:`Deployment`), a bad ``--memory``,
            or no benchmark prompt that fits the target's context.
    """
    pilot = Pilot(opts)
    try:
        torch.manual_seed(opts.seed)
        clear_old_memory(pilot)
        prepare(pilot)
        mark(pilot, "setup")
        p0 = run_phase0(pilot)
        mark(pilot, "phase0")
        inputs = cost_inputs(pilot, p0)
        mark(pilot, "cost_inputs")
        search = run_rounds(pilot, p0)
        mark(pilot, "rounds")
        adversarial = check_adversaries(pilot) if opts.adversarial else []
        mark(pilot, "adversarial")
        return seal(pilot, p0, inputs, search, adversarial)
    finally:
        pilot.dispatch.close()  # idle pooled workers

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


import torch

from specpilot.pilot.adversarial import check_adversaries
from specpilot.pilot.budget import mark
from specpilot.pilot.costinputs import cost_inputs
from specpilot.pilot.phase0 import clear_old_memory, prepare, run_phase0
from specpilot.pilot.rounds import run_rounds
from specpilot.pilot.seal import seal
from specpilot.pilot.state import Pilot, PilotOptions


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

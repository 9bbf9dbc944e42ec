"""The batched pilot's candidate list (paper §4.2, §4.4): lossless row choices, each built from an incumbent.

Every entry of :data:`MECHANISMS` is ``(name, why, make)`` with ``make(incumbent, budgets=()) -> SystemConfig | None``
(None: the mechanism does not apply to that incumbent). ``budgets`` is the measured per-batch-size shared budget
(:func:`specpilot.pilot.batch_budget.shared_budgets`: entry ``m - 1`` for a step over ``m`` requests, from the flat
region of the target's batched pass); only ``shared_budget`` reads it, and without it that candidate falls back to
``nodes * m`` (``SystemConfig.step_budget``). The batched pilot judges the list at each batch size against that
size's incumbent (:mod:`specpilot.pilot.batch_pilot`).
"""

from __future__ import annotations

import math

from specpilot.config import SystemConfig

PROMPT_ADMISSION_ROWS = 256  # prompt rows a step may carry (the paper's FP8 systems admit prompts up to 384 rows)
BEST_FIRST_TOP_K = 4  # candidates per position of the best-first tree


def best_first_tree(inc: SystemConfig, budgets: tuple = ()) -> SystemConfig | None:
    """``inc``'s drafter verified as a best-first tree of ``inc``'s nodes from its top-4 lattice; None where
    ``inc`` is AR or already not a chain."""
    if inc.drafter == "none" or inc.tree != "chain":
        return None
    return inc.apply({"tree": "best_first", "top_k": BEST_FIRST_TOP_K})  # same nodes: the chain's rows, rearranged


def _shared(inc: SystemConfig, budgets: tuple = ()):
    if inc.drafter == "none" or inc.row_selection == "shared_budget":
        return None
    inc = best_first_tree(inc) or inc  # the shared budget fills best-first trees: a chain incumbent gets one too
    return inc.apply({"row_selection": "shared_budget", "shared_budget": tuple(budgets)})


def _block(inc: SystemConfig, budgets: tuple = ()):
    if inc.drafter == "none" or inc.drafter_block:
        return None
    d = inc.depth
    depths = (16, 12, 8) if d >= 16 else tuple(dict.fromkeys((d, math.ceil(3 * d / 4), math.ceil(d / 2))))
    return inc.apply({"drafter_block": depths}) if len(depths) > 1 else None


def _admission(inc: SystemConfig, budgets: tuple = ()):
    return None if inc.prompt_admission else inc.apply({"prompt_admission": PROMPT_ADMISSION_ROWS})


#: the candidate mechanisms, in the order judged: (name, why, (incumbent, budgets) -> candidate or None)
MECHANISMS = (
    ("best_first", "the stock drafter's top-4 lattice verified as a best-first tree of the same nodes as the "
                   "chain (§4.2): no more rows per request, more accepted tokens where the drafter is unsure",
     best_first_tree),
    ("shared_budget", "one node budget per step filled best-first across requests (§4.4), per batch size from the "
                      "flat region of the target's measured batched pass; on a chain incumbent it comes with the "
                      "best-first tree it needs", _shared),
    ("drafter_block", "each request drafts one of (16, 12, 8) positions, picked from its own acceptance (§4.4); a "
                      "drafter of depth D < 16 gets (D, 3D/4, D/2) rounded up", _block),
    ("prompt_admission", f"prompts admitted while requests run ride in the step's exact pass, up to "
                         f"{PROMPT_ADMISSION_ROWS} rows (§4.4)", _admission),
)


def _certified_head(inc: SystemConfig, budgets: tuple = ()):
    return None if inc.lm_head_int8 or inc.dtype != "float32" else inc.apply({"lm_head_int8": True})


#: judged on the CPU only, after :data:`MECHANISMS`: the certified head reads a bf16 copy of a float32 head there
#: (:mod:`specpilot.head.cpu`; AR can use it too); on CUDA the batched engine's graphed step has no certified head
CPU_MECHANISMS = (
    ("lm_head_int8", "the certified head (§4.1): its first pass reads a bf16 copy of the LM head, half the float32 "
                     "head's bytes, and the exact head settles only its few survivors", _certified_head),
)


def learned_mechanism(kind: str, path, stock: SystemConfig, block_size: int | None = None) -> tuple:
    """The entry of a learned drafter the run was given (``--block`` / ``--eagle3``): that checkpoint as a
    best-first tree of stock's node count (the rows per request stock verifies), from its top-4 lattice, as deep as
    those nodes allow (a block drafter: at most its block size ``block_size``). Judged after the calibrated drafter
    and before the row choices, so that those then apply to it; its shared budget is replayed from its own lattices.

    Args:
        kind: ``"block"`` or ``"eagle3"``. path: its directory. stock: the run's stock system.
        block_size: a block drafter's block size (positions one pass drafts); unused for eagle3.
    Returns:
        ``(name, why, make)`` as in :data:`MECHANISMS`; ``make`` gives None where the incumbent already drafts with
        that checkpoint.
    Raises:
        ValueError: another ``kind``, or a block drafter without ``block_size``.
    """
    if kind not in ("block", "eagle3") or (kind == "block" and not block_size):
        raise ValueError(f"a learned drafter is 'block' (with its block size) or 'eagle3', got {kind!r}")
    nodes = max(stock.nodes, 2)
    depth = min(nodes, block_size) if kind == "block" else nodes
    cfg = SystemConfig(drafter=kind, drafter_path=str(path), tree="best_first", nodes=nodes, depth=depth,
                       top_k=BEST_FIRST_TOP_K, dtype=stock.dtype)
    why = (f"the {kind} drafter of {path} as a best-first tree of {nodes} nodes, depth {depth}, "
           f"top-{BEST_FIRST_TOP_K}")
    same = lambda inc: inc.drafter == kind and inc.drafter_path == cfg.drafter_path  # noqa: E731
    return kind, why, lambda inc, budgets=(): None if same(inc) else cfg


def mechanisms_for(device, head_weight) -> tuple:
    """The candidate list the batched pilot judges on ``device`` for a target whose LM head weight is
    ``head_weight``: :data:`MECHANISMS`, then on the CPU :data:`CPU_MECHANISMS` where the certified head's bf16 pass
    can pay (:func:`specpilot.head.cpu.worth`)."""
    import torch

    from specpilot.head.cpu import worth

    return MECHANISMS + (CPU_MECHANISMS if torch.device(device).type == "cpu" and worth(head_weight) else ())


def calibrated_mechanism(path, stock: SystemConfig) -> tuple:
    """The ``calibrated`` entry of the candidate list when the run has a calibration (``--calibration``): the
    SIMULATED drafter of that file as a best-first tree of stock's node count (its depth and top-K capped at what
    the calibration measured), judged first so that the row-selection mechanisms then apply to it. Its figures are
    a simulation of the real pair's acceptance at the real drafter's cost (docs/calibrated-drafter.md).

    Raises:
        SpecPilotError: an unreadable calibration (CalibrationError).
    """
    from specpilot.spec.calibration import load_calibration

    cal = load_calibration(path)
    cfg = SystemConfig(drafter="calibrated", drafter_path=str(path), tree="best_first", nodes=max(stock.nodes, 2),
                       depth=min(cal.depth, max(stock.depth, 2)), top_k=min(cal.top_k, BEST_FIRST_TOP_K),
                       dtype=stock.dtype)
    why = (f"the calibrated drafter of {path} (SIMULATED acceptance) as a best-first tree of {cfg.nodes} nodes, depth "
           f"{cfg.depth}, top-{cfg.top_k}")
    return "calibrated", why, lambda inc, budgets=(): None if inc.drafter == "calibrated" else cfg

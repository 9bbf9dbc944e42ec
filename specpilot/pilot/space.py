"""The planner's candidate space (§3.1): the configs one step from the incumbent that move a ceiling factor, over a
small option grid (every candidate the controller judges costs a paired run), before the cost model ranks them
(:class:`~specpilot.pilot.planner.Planner`).

Drafters come as kinds (``ngram``, ``draft_model``, ``calibrated``: one recording per kind, or per top-K for the
n-gram drafter) or as checkpoints (``block``, ``eagle3``: recordings keyed ``"<kind>:<dir>"``, whose systems carry the
directory as ``drafter_path``).
"""

from __future__ import annotations

import itertools

from specpilot.config import SystemConfig

#: Option grid the planner searches (kept small: every candidate costs a paired run).
NODES = (2, 4, 6, 8, 12, 16, 24, 32)
TOP_K = (2, 4, 8)
DEPTH = (3, 4, 6, 8, 10)
KERNEL_MECHANISMS = ("w12", "lm_head_int8")  # toggled in the ``kernel`` direction (§4.1; SystemConfig bool fields)
#: Block drafters (DFlash-style, ``--block``): block sizes (lattice depth) and builders the planner proposes.
BLOCK_DEPTH = (8, 12, 16)
BLOCK_TREES = ("chain", "best_first", "ddtree_marginal", "eagle2_topk")
#: EAGLE-3 drafters (``--eagle3``): the top-K (children per expanded node, and nodes expanded per depth) each is
#: recorded at. Each K its own recording: the expansion picks which nodes get children, so a top-4 lattice is not
#: the top-16 one cut to 4.
EAGLE3_TOP_K = (4, 8)


def candidate_space(planner, incumbent: SystemConfig, direction: str) -> list[SystemConfig]:
    """:meth:`Planner.space <specpilot.pilot.planner.Planner.space>`: ``planner``'s recordings, TLV inputs and kernel
    mechanisms give the options; ``direction`` is ``tree``, ``outside`` or ``kernel``. Returns distinct configs
    (:func:`_distinct`), the incumbent's equivalents left out."""
    drafters = sorted({kind for kind, _ in planner.recordings if ":" not in kind})  # not a checkpoint's ("<kind>:<dir>")
    blocks = [rec for (kind, _), rec in planner.recordings.items() if kind.startswith("block:")]
    eagles = [(k, rec) for (kind, k), rec in planner.recordings.items() if kind.startswith("eagle3:")]
    out = []

    paths = {kind: rec.drafter_path for (kind, _), rec in planner.recordings.items() if kind == "calibrated"}
    def path(d):  # a calibrated drafter's calibration file goes with it
        return incumbent.drafter_path if d == incumbent.drafter else paths.get(d)

    if direction == "tree":
        for rec in blocks:  # block drafters: kind (checkpoint), block size (depth), builder, N
            for dep in sorted({d for d in BLOCK_DEPTH if d <= rec.depth} | {rec.depth}):
                base = {"drafter": "block", "drafter_path": rec.drafter_path, "top_k": 16, "depth": dep}
                out.append(incumbent.model_copy(update={**base, "tree": "chain", "nodes": dep}))
                for tree, n in itertools.product(BLOCK_TREES[1:], NODES):
                    out.append(incumbent.model_copy(update={**base, "tree": tree, "nodes": n}))
        for k, rec in eagles:  # eagle3 drafters: checkpoint, top-K (as recorded), depth, chain or best-first N
            base = {"drafter": "eagle3", "drafter_path": rec.drafter_path, "top_k": k}
            for dep in (d for d in DEPTH if d <= rec.depth):
                out.append(incumbent.model_copy(update={**base, "tree": "chain", "nodes": dep, "depth": dep}))
                out += [incumbent.model_copy(update={**base, "tree": "best_first", "nodes": n, "depth": min(dep, n)})
                        for n in NODES]
        for d, n, k, dep in itertools.product(drafters, NODES, TOP_K, DEPTH):
            # a best-first tree of n nodes is at most n deep: depth > n is the same system as depth n
            # (uncapped, N=4 with D=4, 8 and 10 were judged as three candidates), so cap it
            out.append(incumbent.model_copy(update={"drafter": d, "drafter_path": paths.get(d), "tree": "best_first",
                                                    "nodes": n, "top_k": k, "depth": min(dep, n)}))
        for d, dep in itertools.product(drafters, DEPTH):
            out.append(incumbent.model_copy(update={"drafter": d, "drafter_path": paths.get(d), "tree": "chain", "nodes": dep, "top_k": 1, "depth": dep}))
        out = _distinct(out)
        if planner.tlv is not None:  # TLV (§4.3) raises tokens per exact pass: each tree candidate with it too
            out += [c.model_copy(update={"tlv": True, "q_weights": planner.tlv.weights}) for c in out
                    if c.drafter != "none" and not c.tlv]
    elif direction == "kernel":
        if planner.kernel_why_not(incumbent) is None:
            for name in planner.kernel_mechanisms():
                out.append(incumbent.model_copy(update={name: not getattr(incumbent, name)}))
    elif direction == "outside":
        for d in drafters + ([incumbent.drafter] if incumbent.drafter in ("block", "eagle3") else []):
            for n in NODES:
                if n < incumbent.nodes:
                    out.append(incumbent.model_copy(update={"drafter": d, "nodes": n, "drafter_path": path(d)}))
            for dep in DEPTH:
                if dep < incumbent.depth:
                    nodes = min(incumbent.nodes, dep) if incumbent.tree == "chain" else incumbent.nodes
                    out.append(incumbent.model_copy(update={"drafter": d, "depth": dep, "nodes": nodes, "drafter_path": path(d)}))
    return [c for c in _distinct(out) if _canonical(c) != _canonical(incumbent)]


def _distinct(cfgs: list[SystemConfig]) -> list[SystemConfig]:
    """One of each set of equivalent configs (same :func:`_canonical`): the smallest N (a measured row count)."""
    best: dict[SystemConfig, SystemConfig] = {}
    for c in cfgs:
        if (key := _canonical(c)) not in best or c.nodes < best[key].nodes:
            best[key] = c
    return list(best.values())


def _canonical(cfg: SystemConfig) -> SystemConfig:
    """``cfg``, best-first N cut to what its lattice holds (K + … + K^D: N=12 D=4 k=1 is N=4); TLV unchanged."""
    cap = sum(cfg.top_k ** d for d in range(1, cfg.depth + 1))
    return cfg.model_copy(update={"nodes": cap}) if cfg.tree == "best_first" and not cfg.tlv and cfg.nodes > cap else cfg

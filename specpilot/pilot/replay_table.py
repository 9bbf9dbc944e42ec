"""The replay table of ``specpilot replay`` (§2.4, §4.2): τ of tree policies on n-gram and block-drafter lattices.

For the n-gram drafter, each block drafter and each bundled benchmark, the lattices along the target's AR greedy outputs are recorded
once (:func:`specpilot.pilot.replay.record`), then τ (tokens per exact pass after the prefill) is computed
exactly for each policy at B = 8 and 16 draft positions: chain (N = B), best_first at N = 8, 16, 32, 63,
eagle2_topk at 16, sequoia at 16, ddtree_marginal at 32, and the top-16 oracle. The Sequoia shape uses the
positional acceptance profile measured on the same recording (in-sample: optimistic for sequoia).
The n-gram drafter is recorded twice: with one match (top-K 1, the engine's stock n-gram chain: the most recent
match) for the chain, and with 16 matches for every other policy (its chain would be the majority of 16 matches).
With ``tlv`` weights, the Q pass of each weight set is recorded once along the same outputs (it depends on the target
alone) and every drafter gets TLV rows (policy ``tlv <builder>``: tokens per exact pass of two-level verification,
:mod:`specpilot.pilot.replay_tlv`) for the :data:`TLV_POLICIES`, beside the Q pass's agreement with the exact pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.errors import SpecPilotError
from specpilot.model.qview import q_view
from specpilot.spec.eagle3 import is_eagle3_dir
from specpilot.spec.trees import SequoiaBuilder, acceptance_profile
from specpilot.pilot.replay import Recording, profile_steps, record, replay
from specpilot.pilot.replay_tlv import QRecording, record_q, replay_tlv

#: (policy, nodes) per block size B; ``None`` nodes = B (the chain and the oracle).
POLICIES = [("chain", None), ("best_first", 8), ("best_first", 16), ("best_first", 32), ("best_first", 63),
            ("eagle2_topk", 16), ("sequoia", 16), ("ddtree_marginal", 32), ("oracle", None)]
BLOCKS = (8, 16)
#: the policies replayed with TLV too, (policy, nodes) as in :data:`POLICIES`
TLV_POLICIES = [("chain", None), ("best_first", 16), ("best_first", 32)]


def _sub(rec: Recording, idx: list[int]) -> Recording:
    """The recording restricted to requests ``idx``."""
    return Recording([rec.prompts[i] for i in idx], [rec.ar[i] for i in idx], [rec.lattices[i] for i in idx],
                     rec.depth, rec.top_k, rec.draft_ms, rec.drafter_path)


def replay_table(target_dir, drafter_dirs, per_benchmark: int = 4, max_new_tokens: int = 64,
                 out: str | Path | None = None, device: str = "cpu", ngram: bool = True,
                 tlv: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    """Record and replay; returns ``(rows, markdown)`` and writes ``table.json``, ``table.md``, ``tau.png``.

    ``drafter_dirs``: block drafter and EAGLE-3 drafter directories (an EAGLE-3 one is recorded with top-K 16:
    16 nodes expanded per depth, 16 children each). ``ngram``: add the n-gram drafter's rows (drafter ``ngram``)
    first. ``tlv``: Q-pass weight sets (``view8``, ``int8``, ``int6``) to add TLV rows for (module docstring); their
    agreement goes to ``tlv.json`` (``{weights: {root, rows, positions}}``) and rows carry ``q_weights``.

    Rows: ``{drafter, benchmark (or "all"), block, policy, nodes, tau, steps}``, float32 CPU by default.
    Raises:
        SpecPilotError (CheckpointError / DrafterError): bad target or drafter directories.
    """
    eagle3_dirs = [Path(d) for d in drafter_dirs if is_eagle3_dir(d)]
    dep = Deployment(target_dir, block_dirs=[d for d in drafter_dirs if not is_eagle3_dir(d)], dtype="float32",
                     device=device)
    tok = dep.tokenizer
    if tok is None:
        raise SpecPilotError(f"{target_dir} has no tokenizer files: the replay table needs the benchmark texts as ids")
    reqs = [r for b in BENCHMARKS for r in load_requests(b, per_benchmark, tok)]
    prompts = [tok(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_eng = dep.system(SystemConfig.ar())
    ar = [ar_eng.generate(p, max_new_tokens).tokens for p in prompts]
    groups = {b: [i for i, r in enumerate(reqs) if r.benchmark == b] for b in BENCHMARKS}
    groups["all"] = list(range(len(reqs)))
    depth = max(BLOCKS)
    recorded = []  # (name, drafter kind, drafter path, {top-K: recording})
    if ngram:
        recs = {k: record(dep.system(SystemConfig(drafter="ngram", top_k=k, depth=depth, nodes=depth)).drafter,
                          prompts, ar, depth, k) for k in (1, 16)}
        recorded.append(("ngram", "ngram", None, recs))
    for d in dep.block_dirs:
        drafter = dep.system(SystemConfig(drafter="block", drafter_path=str(d), top_k=16)).drafter
        rec = record(drafter, prompts, ar, depth, 16, target=dep.target)
        name = d.name if d.name == drafter.cfg.kind else f"{d.name} ({drafter.cfg.kind})"
        recorded.append((name, "block", str(d), {1: rec, 16: rec}))
    for d in eagle3_dirs:
        drafter = dep.system(SystemConfig(drafter="eagle3", drafter_path=str(d), top_k=16, depth=depth,
                                          nodes=depth)).drafter
        rec = record(drafter, prompts, ar, depth, 16, target=dep.target)
        recorded.append((d.name if d.name == "eagle3" else f"{d.name} (eagle3)", "eagle3", str(d), {1: rec, 16: rec}))
    qrecs = {w: record_q(dep.target, q_view(dep.target, w), recorded[0][3][16] if recorded else Recording(prompts, ar),
                         depth, w) for w in tlv}
    rows = []
    for name, kind, path, recs in recorded:
        for b in BLOCKS:
            sequoia = SequoiaBuilder(acceptance_profile(profile_steps(recs[16], b), b))
            for policy, nodes in POLICIES:
                n = b if nodes is None else nodes
                tree = "best_first" if policy == "oracle" else policy
                k = 1 if policy == "chain" else 16
                cfg = SystemConfig(drafter=kind, drafter_path=path, tree=tree, nodes=n, depth=b, top_k=k)
                for bench, idx in groups.items():
                    tau, steps = replay(_sub(recs[k], idx), cfg, "oracle" if policy == "oracle" else None, sequoia)
                    rows.append({"drafter": name, "benchmark": bench, "block": b, "policy": policy, "nodes": n,
                                 "tau": round(tau, 4), "steps": steps})
                if (policy, nodes) in TLV_POLICIES:
                    rows += _tlv_rows(qrecs, recs[k], cfg, groups, name, b, policy)
    md = _markdown(rows, len(reqs), max_new_tokens)
    agree = {w: q.agreement(recorded[0][3][16]) for w, q in qrecs.items()} if qrecs else {}
    for w, a in agree.items():  # the Q pass's top-1 against the exact pass's, under the table
        md += (f"\nQ pass ({w}) agrees with the exact pass at {a['root']:.1%} of root rows and {a['rows']:.1%} of "
               f"chain rows ({a['positions']} positions)")
    if out is not None:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
        (o / "table.md").write_text(md + "\n")
        if qrecs:
            (o / "tlv.json").write_text(json.dumps(agree, indent=1) + "\n")
        _plot(rows, o / "tau.png")
    return rows, md


def _tlv_rows(qrecs: dict[str, QRecording], rec: Recording, cfg: SystemConfig, groups: dict, name: str, b: int,
              policy: str) -> list[dict]:
    """TLV rows of one drafter, block and policy: one per Q weight set and benchmark group."""
    rows = []
    for w, q in qrecs.items():
        for bench, idx in groups.items():
            r = replay_tlv(_sub(rec, idx), QRecording([q.chains[i] for i in idx], q.depth, q.weights), cfg)
            rows.append({"drafter": name, "benchmark": bench, "block": b, "policy": f"tlv {policy}", "nodes": cfg.nodes,
                         "tau": round(r["tau"], 4), "steps": r["steps"], "q_weights": w,
                         "chain": round(r["chain"], 4), "q_rows": round(r["q_rows"], 4),
                         "exact_rows": round(r["exact_rows"], 4)})
    return rows


def _markdown(rows: list[dict], n_prompts: int, max_new: int) -> str:
    benches = list(BENCHMARKS) + ["all"]
    lines = [f"τ by exact replay ({n_prompts} prompts, ≤ {max_new} AR tokens each; float32 CPU)", "",
             "| drafter | B | policy | N | " + " | ".join(benches) + " |",
             "|---|---:|---|---:|" + "---:|" * len(benches)]
    keyed = {(r["drafter"], r["block"], _policy(r), r["nodes"], r["benchmark"]): r["tau"] for r in rows}
    seen = []
    for r in rows:
        k = (r["drafter"], r["block"], _policy(r), r["nodes"])
        if k not in seen:
            seen.append(k)
    for k in seen:
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(f"{keyed[(*k, b)]:.2f}" for b in benches) + " |")
    return "\n".join(lines)


def _policy(row: dict) -> str:
    """A row's policy as the table prints it (TLV rows name their Q weights)."""
    return f"{row['policy']} ({row['q_weights']})" if "q_weights" in row else row["policy"]


def _plot(rows: list[dict], path: Path) -> None:
    """Bar chart of τ (all benchmarks pooled) per policy, one panel per drafter, bars per B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    labels = [f"{p} {'B' if n is None else n}" for p, n in POLICIES]
    fig, axes = plt.subplots(1, len(drafters), figsize=(6 * len(drafters), 4), squeeze=False)
    for ax, dname in zip(axes[0], drafters):
        for j, b in enumerate(BLOCKS):
            vals = [next(r["tau"] for r in rows if r["drafter"] == dname and r["block"] == b and r["policy"] == p
                         and r["nodes"] == (b if n is None else n) and r["benchmark"] == "all") for p, n in POLICIES]
            ax.bar(np.arange(len(vals)) + 0.4 * j, vals, 0.4, label=f"B = {b}")
        ax.set_xticks(np.arange(len(labels)) + 0.2, labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("τ (tokens per exact pass)")
        ax.set_title(dname)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

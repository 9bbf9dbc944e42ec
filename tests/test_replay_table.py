"""The replay table (``specpilot replay``) holds the n-gram drafter next to the block drafters, and its rows are
what the live engine measures on the same prompts (bundled pair, float32 CPU)."""

from __future__ import annotations

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.pilot.replay_table import POLICIES, replay_table
from specpilot.zoo import bundled_block_dir, bundled_target_dir


def test_table_has_ngram_rows_equal_to_live(tmp_path):
    n_new = 12
    rows, md = replay_table(bundled_target_dir(), [bundled_block_dir()], per_benchmark=1, max_new_tokens=n_new,
                            out=tmp_path)
    assert {r["drafter"] for r in rows} == {"ngram", "block"}
    assert (tmp_path / "table.json").is_file() and "| ngram | 16 | chain | 16 |" in md
    for drafter in ("ngram", "block"):  # every policy at both block sizes, per benchmark and pooled
        assert len([r for r in rows if r["drafter"] == drafter]) == 2 * len(POLICIES) * (len(BENCHMARKS) + 1)
    tau = {(r["drafter"], r["block"], r["policy"], r["nodes"]): r["tau"] for r in rows if r["benchmark"] == "all"}
    assert tau[("ngram", 16, "oracle", 16)] >= tau[("ngram", 16, "best_first", 32)] >= 1.0
    dep = Deployment(bundled_target_dir(), dtype="float32")
    prompts = [dep.tokenizer(r.text, add_special_tokens=False)["input_ids"]
               for b in BENCHMARKS for r in load_requests(b, 1, dep.tokenizer)]
    for tree, nodes, k in (("chain", 16, 1), ("best_first", 32, 16)):  # the chain is the stock one-match chain
        eng = dep.system(SystemConfig(drafter="ngram", tree=tree, nodes=nodes, depth=16, top_k=k))
        gens = [eng.generate(p, n_new) for p in prompts]
        live = sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens)
        assert round(live, 4) == tau[("ngram", 16, tree, nodes)], (tree, live)

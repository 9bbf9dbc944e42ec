"""Exact replay of TLV (§4.3): replayed tokens per exact pass equal the engine's, cycle by cycle, for drafters
that read no target features (float32 CPU); the Q pass's agreement is counted from the recorded chains."""

from __future__ import annotations

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.qview import q_view
from specpilot.pilot.replay import record, replay
from specpilot.pilot.replay_tlv import record_q, replay_tlv, replay_tlv_steps

from .conftest import random_prompts
from .test_engine import ar_tokens
from .test_tlv import drafter_of

pytestmark = pytest.mark.usefixtures("one_thread")
V, T, D = 64, 30, 6


@pytest.mark.parametrize("kind,tree,weights", [("ngram", "best_first", "view8"), ("draft_model", "best_first", "int6"),
                                               ("draft_model", "chain", "view8"), ("draft_model", "sequoia", "int8")])
def test_replayed_cycles_equal_the_engine(tiny_models, kind, tree, weights):
    target, small = tiny_models
    chain = tree == "chain"
    cfg = SystemConfig(drafter=kind, tree=tree, nodes=D if chain else 10, depth=D, top_k=1 if chain else 3)
    prompts = random_prompts(4, V, length=10, seed=12)
    ars = [ar_tokens(target, p, T) for p in prompts]
    rec = record(drafter_of(kind, target, small, cfg.top_k), prompts, ars, D, cfg.top_k)
    qrec = record_q(target, q_view(target, weights), rec, D, weights)
    steps = replay_tlv_steps(rec, qrec, cfg)
    eng = Engine(target, cfg.model_copy(update={"tlv": True, "q_weights": weights}),
                 drafter_of(kind, target, small, cfg.top_k), eos_ids=[])
    live = [eng.generate(p, T) for p in prompts]
    assert [g.tokens for g in live] == ars
    assert [k for k, *_ in steps] == [a for g in live for a in g.accepted]  # every cycle's tokens, in order
    live_rows = [r for g in live for r in g.rows]
    # replay counts a wrong chain's exact pass at the full 1 + N rows, an upper bound; right chains exactly
    assert all(r >= lr for (_, r, _, _), lr in zip(steps, live_rows))
    assert sum(r == lr for (_, r, _, _), lr in zip(steps, live_rows)) >= 0.5 * len(steps)
    summary = replay_tlv(rec, qrec, cfg)
    assert summary["tau"] == pytest.approx(sum(sum(g.accepted) for g in live) / sum(g.steps for g in live))
    assert summary["tau"] > replay(rec, cfg)[0]
    agree = qrec.agreement(rec)
    assert 0.5 < agree["root"] <= 1.0 and agree["positions"] == sum(len(a) - 1 for a in ars)


def test_planner_prices_and_proposes_tlv(tiny_models):
    """The planner's TLV price: τ is the replayed cycles', c adds the Q pass and the second draft to the exact pass;
    the tree direction proposes each candidate with TLV too."""
    from specpilot.pilot.planner import Planner
    from specpilot.pilot.tlv_cost import TlvInputs

    target, small = tiny_models
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=10, depth=D, top_k=3)
    prompts = random_prompts(3, V, length=10, seed=13)
    ars = [ar_tokens(target, p, T) for p in prompts]
    rec = record(drafter_of("draft_model", target, small, 3), prompts, ars, D, 3)
    qrec = record_q(target, q_view(target), rec, D)
    verify = {1: 1.0, 4: 1.2, 8: 1.4, 16: 1.8}
    tlv = TlvInputs(qrec, {r: 0.5 * ms for r, ms in verify.items()}, "view8")
    plain = Planner({("draft_model", 3): rec}, verify, ar_ms=1.0)
    planner = Planner({("draft_model", 3): rec}, verify, ar_ms=1.0, tlv=tlv)
    on = cfg.model_copy(update={"tlv": True})
    pred, single = planner.predict(on), planner.predict(cfg)
    assert plain.predict(on) is None and single.tau == plain.predict(cfg).tau  # (c: the host tree time is timed)
    assert pred.tau == pytest.approx(replay_tlv(rec, qrec, cfg)["tau"]) and pred.tau > single.tau
    steps = replay_tlv_steps(rec, qrec, cfg)
    q_mean = sum(tlv.q_time(q) for _, _, q, _ in steps) / len(steps)
    assert q_mean > 0 and pred.c > single.c  # a cycle costs a Q pass (and drafts) on top of its exact pass
    assert planner.predict(on.model_copy(update={"q_weights": "int8"})) is None  # not recorded
    space = planner.space(SystemConfig.ar(), "tree")
    assert any(c.tlv for c in space) and {c.model_copy(update={"tlv": False}) for c in space if c.tlv} <= set(space)


def test_replay_table_prints_the_q_pass_agreement(tmp_path):
    """`specpilot replay --tlv view8` prints the Q pass's agreement under its table (as the README says), the same
    figures as tlv.json."""
    import json

    from specpilot.pilot.replay_table import replay_table
    from specpilot.zoo import bundled_block_dir, bundled_target_dir

    rows, md = replay_table(bundled_target_dir(), [bundled_block_dir()], per_benchmark=1, max_new_tokens=8,
                            out=tmp_path, tlv=("view8",))
    a = json.loads((tmp_path / "tlv.json").read_text())["view8"]
    assert f"Q pass (view8) agrees with the exact pass at {a['root']:.1%} of root rows" in md and a["positions"] > 0
    assert any(r.get("q_weights") == "view8" for r in rows)

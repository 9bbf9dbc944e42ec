"""Exact replay on a tiny hybrid (qwen3_5: Gated DeltaNet + gated attention) target, CPU float32: for every drafter
kind (n-gram, dense and hybrid draft models, block, block_markov and eagle3 drafters reading the hybrid's features)
the τ and step count replay computes from one recording equal the live engine's, for every tree builder (chains
verified with state snapshots, trees with replayed commits) and a smaller node budget and depth; ``specpilot replay``
runs on a tiny hybrid with the bundled tokenizer and a block drafter reading its features."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.model.checkpoint import load_model
from specpilot.pilot.replay import record, replay
from specpilot.spec.block import BlockNet, save_block
from specpilot.spec.trees import BUILDERS
from specpilot.zoo import bundled_target_dir

from .blockutil import tiny_config
from .conftest import run_cli
from .hybridutil import KINDS, TOP_K, ar_tokens, drafter_nets, make_drafter, requests, tiny_target, verify_mode
from .test_hybrid import TINY, tiny_hybrid

V = TINY["vocab_size"]
DEPTH = 5
POLICIES = [(b, 12, DEPTH) for b in sorted(BUILDERS)] + [("best_first", 4, 3)]


def live(target, drafter, cfg, reqs, ar):
    """``(τ, steps)`` of the engine on ``reqs`` (``(prompt, new tokens)``; the outputs checked against ``ar``)."""
    eng = Engine(target, cfg, drafter, eos_ids=[])
    gens = [eng.generate(p, n) for p, n in reqs]
    assert [g.tokens for g in gens] == ar
    return sum(sum(g.accepted) for g in gens) / sum(g.steps for g in gens), sum(g.steps for g in gens)


@pytest.mark.parametrize("kind", KINDS)
def test_replay_equals_live(kind):
    target, nets = tiny_target(), drafter_nets()
    reqs = requests(V)
    ar = [ar_tokens(target, p, n) for p, n in reqs]
    name, drafter = make_drafter(kind, target, nets)
    rec = record(drafter, [p for p, _ in reqs], ar, DEPTH, TOP_K, target=target)
    taus = []
    for tree, nodes, depth in POLICIES:
        cfg = SystemConfig(drafter=name, tree=tree, nodes=nodes, depth=depth, top_k=TOP_K)
        with verify_mode(target, "snapshot" if tree == "chain" else "replay"):
            want = live(target, make_drafter(kind, target, nets)[1], cfg, reqs, ar)
        got = replay(rec, cfg)
        assert got == want, (kind, tree, nodes, depth, got, want)
        taus.append(got[0])
    assert max(taus) > 1.0  # some drafted token was accepted: the comparison is not all-ones


def test_replay_cli_on_a_hybrid(tmp_path, monkeypatch, capsys):
    """The replay table of a hybrid target (vocabulary of the bundled tokenizer, which it borrows) and a random block
    drafter reading its GDN and attention layers: every row has a τ of at least 1."""
    tdir = tmp_path / "target"
    tiny_hybrid(tdir, seed=4, vocab_size=4096, eos_token_id=0, pad_token_id=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_target_dir() / f, tdir / f)
    torch.manual_seed(0)
    save_block(BlockNet(dataclasses.replace(tiny_config(load_model(tdir)), target_layers=[0, 1, 3])).eval(),
               tmp_path / "block")
    code, out, err = run_cli(monkeypatch, capsys, "replay", "--target", str(tdir), "--drafter", str(tmp_path / "block"),
                             "--per-benchmark", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "out"), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert {r["drafter"] for r in rows} == {"ngram", "block"} and all(r["tau"] >= 1.0 for r in rows)
    assert {r["policy"] for r in rows} >= {"chain", "best_first", "eagle2_topk", "sequoia", "ddtree_marginal"}

"""EAGLE-3 drafters: losslessness with every tree builder (float32 CPU, AR is the oracle), training with the
training-time test lowers the loss, drafting agrees with the training forward, slots, checkpoints through the
Deployment, and `train-drafter --kind eagle3` end to end."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.errors import DrafterError
from specpilot.spec.drafter import Drafter, DraftRequest, check_fits
from specpilot.spec.eagle3 import Eagle3Drafter, load_eagle3, save_eagle3
from specpilot.spec.lattice import TreeLattice
from specpilot.spec.train_eagle3 import draft_vocab, ttt_logits
from specpilot.spec.trees import BUILDERS

from .blockutil import greedy_data, train_eagle3_tiny
from .conftest import random_prompts
from .test_engine import ar_tokens, cache_matches_prefill

LAYERS = (0, 1, 1)  # low / mid / high of the 2-layer tiny target
PROMPT = 12


@functools.lru_cache(maxsize=None)
def _trained(target):
    """A tiny eagle3 drafter trained 150 steps (draft vocabulary 48 of 64 ids); ``(net, losses, seqs, feats)``."""
    target.requires_grad_(False)
    seqs = greedy_data(target, prompt_len=PROMPT)
    net, losses, feats = train_eagle3_tiny(target, LAYERS, seqs, 48, steps=150, prompt_len=PROMPT)
    return net, losses, seqs, feats


@pytest.fixture(scope="module")
def trained(tiny_models):
    return _trained(tiny_models[0])


def test_training_lowers_loss(trained):
    losses = trained[1]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.7 * first, (first, last)


def test_draft_vocab_is_most_frequent():
    seqs = torch.tensor([[9, 9, 1, 1, 1, 2, 3, 3]])
    assert draft_vocab(seqs, 2, 10, 2).tolist() == [1, 3]  # after the 2-token prompt: 1 x3, 3 x2, 2 x1
    assert draft_vocab(seqs, 5, 10, 2).tolist() == [0, 1, 2, 3, 4]  # unseen ids fill up, lowest first


@pytest.mark.parametrize("tree", sorted(BUILDERS))
def test_spec_equals_ar_every_builder(tiny_models, trained, tree):
    target, net = tiny_models[0], trained[0]
    for nodes, depth, k in ((8, 6, 4), (20, 4, 8), (5, 5, 1)):
        cfg = SystemConfig(drafter="eagle3", tree=tree, nodes=nodes, depth=depth, top_k=k)
        eng = Engine(target, cfg, Eagle3Drafter(net, target, top_k=k), eos_ids=[])
        eng.step_hook = cache_matches_prefill
        for p in random_prompts(2, length=10, seed=11):
            gen = eng.generate(p, 30)
            assert gen.tokens == ar_tokens(target, p, 30)
            assert max(gen.accepted) <= depth + 1 and max(gen.rows) <= nodes + 1


def test_trained_drafter_accepts_tokens(tiny_models, trained):
    """On the repetitive tiny target a trained drafter must accept more than AR's 1 token per pass."""
    target = tiny_models[0]
    cfg = SystemConfig(drafter="eagle3", tree="best_first", nodes=16, depth=6, top_k=4)
    eng = Engine(target, cfg, Eagle3Drafter(trained[0], target, top_k=4), eos_ids=[])
    taus = [eng.generate(p, 40).tau for p in random_prompts(4, length=12, seed=5)]
    assert sum(taus) / len(taus) > 1.5, taus


def test_drafting_agrees_with_training_forward(tiny_models, trained):
    """The drafter's first position equals training-time-test step 0 at row n - 2, and the children of the target's
    token equal step 1 there (the drafter's own hidden fed back): training and drafting run the same rows."""
    target, (net, _, seqs, feats) = tiny_models[0], trained
    steps = ttt_logits(net, target, seqs[:1], feats[:1], 2)
    n = 30
    d = Eagle3Drafter(net, target, top_k=48, expand=48)
    d.observe(0, feats[0, : n - 1], 0)
    lat = d.propose([DraftRequest(0, seqs[0, :n].tolist(), 2)])[0]
    assert isinstance(lat, TreeLattice)
    for path, logits in (((), steps[0][0, n - 2]), ((int(seqs[0, n]),), steps[1][0, n - 2])):
        if path and not net.t2d[path[0]]:
            continue
        want = dict(zip(net.to_target(torch.arange(48)).tolist(), logits.log_softmax(-1).tolist()))
        kids = lat.children(path)
        assert len(kids) == 48 and max(abs(lp - want[t]) for t, lp in kids) < 1e-4


def test_slots_are_independent(tiny_models, trained):
    """Two requests in two slots, observed in chunks and interleaved, get the lattices they get alone."""
    target, (net, _, seqs, feats) = tiny_models[0], trained
    alone = []
    for i in (0, 1):
        d = Eagle3Drafter(net, target, top_k=3)
        d.observe(0, feats[i, :20], 0)
        alone.append(d.propose([DraftRequest(0, seqs[i, :21].tolist(), 4)])[0])
    both = Eagle3Drafter(net, target, top_k=3, max_slots=3, max_len=4)  # buffers grow
    both.observe(2, feats[1, :7], 0)
    both.observe(0, feats[0, :20], 0)
    both.observe(2, feats[1, 7:20], 7)
    got = both.propose([DraftRequest(2, seqs[1, :21].tolist(), 4), DraftRequest(0, seqs[0, :21].tolist(), 4)])
    for g, a in zip(got[::-1], alone):
        for path in [()] + [(t,) for t, _ in a.children(())]:
            assert [t for t, _ in g.children(path)] == [t for t, _ in a.children(path)]
            assert np.allclose([p for _, p in g.children(path)], [p for _, p in a.children(path)], atol=1e-5)
    with pytest.raises(DrafterError, match="twice"):
        both.propose([DraftRequest(0, seqs[0, :21].tolist(), 2)] * 2)
    with pytest.raises(DrafterError, match="slot 3"):
        both.reset(3)
    with pytest.raises(RuntimeError, match="features of 20 positions"):
        both.propose([DraftRequest(0, seqs[0, :25].tolist(), 2)])


def test_checkpoint_through_deployment(tiny_dirs, tiny_models, trained, tmp_path):
    """Saved (float32 here), loaded by kind from --drafter-path, protocol checked, lossless in the batched engine."""
    target, net = tiny_models[0], trained[0]
    out = save_eagle3(net, tmp_path / "e3", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specpilot_drafter"] == "eagle3" and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    back = load_eagle3(out, target)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), net.state_dict().values()))
    dep = Deployment(tiny_dirs[0], out)
    sysc = SystemConfig(drafter="eagle3", tree="best_first", nodes=10, depth=5, top_k=4)
    eng = dep.system(sysc, eos_ids=[])
    assert isinstance(eng.drafter, Drafter) and eng.drafter.kind == "eagle3"
    check_fits(eng.drafter, 64, 2)
    prompts = random_prompts(3, length=10, seed=3)
    batch = dep.batch_system(sysc, max_num_seqs=3, eos_ids=[])
    outs = batch.generate_all(prompts, 20)
    for p, o in zip(prompts, outs):
        assert o.tokens == ar_tokens(dep.target, p, 20)
    with pytest.raises(DrafterError, match="needs an EAGLE-3"):
        Deployment(tiny_dirs[0]).system(SystemConfig(drafter="eagle3"))


def test_train_drafter_eagle3_end_to_end(tmp_path, tiny_dirs, monkeypatch, capsys):
    """`specpilot train-drafter --kind eagle3` on a tiny HF target: a loadable checkpoint, provenance, loss drops."""
    from .conftest import run_cli

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, 20000).astype(np.uint16))
    out = tmp_path / "e3"
    code, stdout, err = run_cli(monkeypatch, capsys, "train-drafter", "--kind", "eagle3", "--target", tiny_dirs[0],
                                "--out", str(out), "--tokens", str(tokens), "--steps", "40", "--batch-size", "8",
                                "--lr", "3e-3", "--n-seqs", "24", "--prompt-len", "12", "--gen-len", "24",
                                "--draft-vocab", "40", "--ttt-steps", "2", "--quiet")
    assert code == 0, err
    assert json.loads((out / "provenance.json").read_text())["data"]["prompt_len"] == 12
    res = json.loads(stdout.strip().splitlines()[-1])
    assert res["kind"] == "eagle3" and res["eagle3"]["draft_vocab_size"] == 40
    assert res["final_heldout_loss"] < res["initial_heldout_loss"]
    assert (out / "loss.png").stat().st_size > 1000
    net = Deployment(tiny_dirs[0], out).eagle3_net()
    assert net.cfg.draft_vocab_size == 40 and int(net.t2d.sum()) == 40
    code, _, err = run_cli(monkeypatch, capsys, "train-drafter", "--kind", "eagle3", "--target", tiny_dirs[0],
                           "--out", str(tmp_path / "bad"), "--tokens", str(tokens), "--draft-vocab", "65", "--quiet")
    assert code == 2 and "--draft-vocab must be in [1, 64]" in err and len(err.strip().splitlines()) == 1


def test_truncated_drafter_weights_are_one_line(tiny_models, trained, tmp_path, monkeypatch, capsys):
    """Fresh-user run: a truncated ``model.safetensors`` in a drafter directory gave safetensors' 65-126-line
    traceback; now a one-line error naming the file, for eagle3 and block drafters (the CLI's exit 2)."""
    import shutil

    from specpilot.zoo import bundled_block_dir

    from .conftest import run_cli

    out = save_eagle3(trained[0], tmp_path / "e3", dtype=torch.float32)
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(DrafterError, match="not a readable safetensors file"):
        load_eagle3(out, tiny_models[0])
    block = shutil.copytree(bundled_block_dir(), tmp_path / "block")
    w = block / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--drafter", "block", "--drafter-path",
                           str(block))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a readable safetensors file" in err, err

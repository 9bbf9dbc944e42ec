"""Block drafters (DFlash-style, DSpark Markov head): losslessness with every builder, the Markov head's
conditioning, checkpoints and errors, and that training lowers the loss. float32 CPU; AR is the oracle."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.spec.block import BlockDrafter, BlockNet, load_block, save_block
from specpilot.spec.lattice import MarkovLattice
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.errors import DrafterError
from specpilot.spec.trees import BUILDERS, build_chain
from specpilot.spec.drafter import propose_one

from .blockutil import tiny_config, trained_pair
from .conftest import random_prompts, save_tiny
from .test_engine import ar_tokens, cache_matches_prefill


@pytest.fixture(scope="module")
def pair(tiny_models):
    return trained_pair(tiny_models[0])


def test_training_lowers_loss(pair):
    for kind, (_, losses) in pair.items():
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < 0.7 * first, (kind, first, last)


@pytest.mark.parametrize("kind", ["block", "block_markov"])
@pytest.mark.parametrize("tree", sorted(BUILDERS))
def test_spec_equals_ar_every_builder(tiny_models, pair, kind, tree):
    target = tiny_models[0]
    net = pair[kind][0]
    for nodes, depth in ((8, 6), (20, 4)):
        cfg = SystemConfig(drafter="block", tree=tree, nodes=nodes, depth=depth, top_k=16)
        eng = Engine(target, cfg, BlockDrafter(net, target), eos_ids=[])
        eng.step_hook = cache_matches_prefill
        for p in random_prompts(2, length=10, seed=11):
            gen = eng.generate(p, 30)
            assert gen.tokens == ar_tokens(target, p, 30)
            assert max(gen.accepted) <= depth + 1
            assert max(gen.rows) <= nodes + 1


def test_block_drafter_accepts_tokens(tiny_models, pair):
    """A trained drafter on a repetitive tiny target must accept more than AR's 1 token per pass."""
    target = tiny_models[0]
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=16, depth=6, top_k=16)
    eng = Engine(target, cfg, BlockDrafter(pair["block"][0], target), eos_ids=[])
    taus = [eng.generate(p, 40).tau for p in random_prompts(4, length=12, seed=5)]
    assert sum(taus) / len(taus) > 1.5


def _drafter_at(target, net, prompt):
    """A drafter holding the context of ``prompt``; returns (drafter, committed = prompt + [AR token])."""
    d = BlockDrafter(net, target)
    feats: list = []
    h = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), target.new_cache(len(prompt)), 0,
                       features=feats, feature_layers=d.target_layers)
    d.observe(0, torch.cat(feats, -1), 0)
    return d, prompt + [target.logits(h)[-1].argmax().item()]


def test_markov_head_conditions_on_parent(tiny_models, pair):
    target = tiny_models[0]
    net = BlockNet(pair["block_markov"][0].cfg)
    net.load_state_dict(pair["block_markov"][0].state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        net.markov_v.weight.add_(torch.randn_like(net.markov_v.weight))  # a strong bias: visible effect
    differs = 0
    for p in random_prompts(6, length=12, seed=21):
        d, committed = _drafter_at(target, net, p)
        lat = propose_one(d, committed, 6)
        assert isinstance(lat, MarkovLattice) and lat.depth == 6
        t0 = [t for t, _ in lat.marginal(())]
        cands = [t for t, _ in lat.marginal((t0[0],))]
        a, b = lat.score(1, t0[0], cands), lat.score(1, t0[1], cands)
        assert not torch.allclose(a, b)
        # exact renormalization: log-softmax over the full vocabulary of base logits + the parent's bias
        logits = d.block_logits(committed)
        ref = torch.log_softmax(logits[1] + net.markov_bias(torch.tensor(t0[1])), -1)[cands]
        torch.testing.assert_close(b, ref, atol=1e-5, rtol=1e-5)
        ref0 = torch.log_softmax(logits[0] + net.markov_bias(torch.tensor(committed[-1])), -1)[t0]
        torch.testing.assert_close(lat.score(0, committed[-1], t0), ref0, atol=1e-5, rtol=1e-5)
        kids = lat.children((t0[1],))
        assert [lp for _, lp in kids] == sorted((lp for _, lp in kids), reverse=True)
        assert {t for t, _ in kids} == set(cands)
        with pytest.raises(ValueError):
            lat.score(0, (committed[-1] + 1) % 64, t0)
        chain = build_chain(lat, 6).tokens
        marginal_chain = [lat.marginal((0,) * k)[0][0] for k in range(lat.depth)]
        differs += chain != marginal_chain
    assert differs > 0


def test_checkpoint_roundtrip_and_errors(tmp_path, tiny_dirs, tiny_models, pair):
    target = tiny_models[0]
    net = pair["block_markov"][0]
    d = save_block(net, tmp_path / "bm")
    back = load_block(d, target)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v.to(torch.bfloat16).float())
    dep = Deployment(tiny_dirs[0], d)
    assert dep.draft_model is None and dep.block_dirs == [d]
    eng = dep.system(SystemConfig(drafter="block", tree="best_first", nodes=8, depth=6, top_k=16), eos_ids=[])
    p = random_prompts(1, seed=3)[0]
    assert eng.generate(p, 20).tokens == ar_tokens(target, p, 20)
    other = save_tiny(tmp_path / "wide", hidden=96, layers=2, heads=4, kv_heads=2, seed=4)
    with pytest.raises(DrafterError, match="hidden"):
        Deployment(other, d)
    shallow = save_tiny(tmp_path / "shallow", hidden=64, layers=1, seed=4)
    with pytest.raises(DrafterError, match="layers"):
        Deployment(shallow, d)
    with pytest.raises(DrafterError, match="block drafter"):
        Deployment(tiny_dirs[0]).system(SystemConfig(drafter="block"))


def test_train_drafter_end_to_end(tmp_path, tiny_dirs):
    """`train-drafter` on a tiny target: writes a loadable checkpoint, provenance and loss curve; loss drops."""
    import json

    import numpy as np

    from specpilot.spec.train_block import train_drafter

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, 20000).astype(np.uint16))
    out = tmp_path / "bd"
    prov = train_drafter(tiny_dirs[0], out, kind="block_markov", block=4, steps=40, batch_size=8, anchors=4,
                         lr=3e-3, n_seqs=24, prompt_len=8, gen_len=24, markov_rank=4, layers=1,
                         target_layers=(0, 1), tokens_path=tokens, quiet=True)
    assert prov["final_heldout_loss"] < prov["initial_heldout_loss"]
    assert (out / "loss.png").stat().st_size > 1000
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specpilot_drafter"] == "block" and cfg["kind"] == "block_markov" and cfg["block_size"] == 4
    assert json.loads((out / "provenance.json").read_text())["data"]["sequences"] == 24
    from specpilot.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="at least 16"):  # fewer draft ids than candidates a position
        train_drafter(tiny_dirs[0], tmp_path / "dv", kind="block", block=4, steps=1, batch_size=8, n_seqs=24,
                      prompt_len=8, gen_len=24, layers=1, target_layers=(0, 1), tokens_path=tokens, quiet=True,
                      draft_vocab_size=15)


def test_train_drafter_time_budget_shortens_the_run(tmp_path, tiny_dirs):
    """A wall-time budget far below the planned run stops it after the 10 timed steps + 1, with the schedule
    re-planned (so the last step is the warm-down's), and says so in the provenance."""
    import numpy as np

    from specpilot.spec.train_block import train_drafter

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, 20000).astype(np.uint16))
    prov = train_drafter(tiny_dirs[0], tmp_path / "bd", kind="block", block=4, steps=100000, batch_size=4,
                         n_seqs=24, prompt_len=8, gen_len=24, layers=1, target_layers=(0, 1), tokens_path=tokens,
                         quiet=True, max_seconds=1e-6)
    t = prov["training"]
    assert t["steps"] == 11 and t["planned_steps"] == 100000 and t["max_seconds"] == 1e-6
    assert prov["heldout_curve"][-1][0] == 11  # evaluated at the re-planned end


def test_bundled_block_drafters_sizes_and_provenance():
    import json

    from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir, bundled_drafter_dir, bundled_target_dir

    dirs = [bundled_block_dir(), bundled_block_markov_dir()]
    if not all((d / "model.safetensors").is_file() for d in dirs):
        pytest.skip("bundled block drafters not built")
    total = 0
    for d in dirs:
        prov = json.loads((d / "provenance.json").read_text())
        for key in ("command", "seed", "steps", "final_train_loss", "git_commit", "data"):
            assert key in prov, (d, key)
        assert prov["final_heldout_loss"] < prov["initial_heldout_loss"]
        assert json.loads((d / "config.json").read_text())["kind"] == d.name
    for d in dirs + [bundled_target_dir(), bundled_drafter_dir()]:
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total < 30e6


def test_default_target_layers_follow_the_targets_depth(monkeypatch, capsys, tmp_path):
    """Low, middle and high layers of any depth (the bundled drafters' 1, 3, 5 for 6 layers); a bad
    ``--target-layers`` is one line and exit 2."""
    from specpilot.spec.train_block import default_target_layers

    from .conftest import run_cli

    assert default_target_layers(6) == (1, 3, 5) and default_target_layers(30) == (1, 15, 29)
    assert default_target_layers(36) == (1, 18, 35) and default_target_layers(2) == (1,)
    assert default_target_layers(1) == (0,)
    for bad, why in (("1,x", "comma-separated integers"), ("1,99", "cannot read layers [1, 99]")):
        code, _, err = run_cli(monkeypatch, capsys, "train-drafter", "--out", str(tmp_path / bad), "--target-layers",
                               bad, "--tokens", str(tmp_path / "none.npy"), "--steps", "1", "--quiet")
        assert code == 2 and len(err.strip().splitlines()) == 1 and why in err, err


def test_train_drafter_reuses_its_data_cache(tmp_path, tiny_dirs, monkeypatch):
    """A ``data_cache`` written by one run is read back (memory-mapped) by the next run with the same key, which
    generates nothing; a run with another key regenerates and rewrites it."""
    import numpy as np
    import torch

    import specpilot.spec.train_block as tb

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, 20000).astype(np.uint16))
    cache = tmp_path / "cache.pt"
    kw = dict(kind="block", block=4, steps=2, batch_size=4, n_seqs=12, prompt_len=8, gen_len=12, layers=1,
              target_layers=(0, 1), tokens_path=tokens, quiet=True, data_cache=cache)
    tb.train_drafter(tiny_dirs[0], tmp_path / "a", **kw)
    first = torch.load(cache)
    calls = []
    real = tb.make_sequences
    monkeypatch.setattr(tb, "make_sequences", lambda *a, **k: calls.append(a) or real(*a, **k))
    tb.train_drafter(tiny_dirs[0], tmp_path / "b", **kw)
    assert calls == []  # same key: read back, nothing generated
    tb.train_drafter(tiny_dirs[0], tmp_path / "c", **{**kw, "gen_len": 14})
    assert len(calls) == 1 and torch.load(cache)["seqs"].shape == (12, 22)
    assert first["seqs"].shape == (12, 20) and first["feats"].shape[:2] == (12, 20)

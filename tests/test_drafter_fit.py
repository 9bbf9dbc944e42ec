"""R16: a drafter that does not fit its target is refused when the engine is built, through the Python API too;
a drafter asked to draft beyond its own context stops there, and the output still equals greedy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.engine import Engine
from specpilot.errors import DrafterError
from specpilot.model.checkpoint import load_model
from specpilot.spec.block import BlockDrafter, BlockNet
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.drafter import Drafter, DraftRequest

from .blockutil import tiny_config
from .conftest import random_prompts, save_tiny
from .test_engine import ar_tokens


def test_a_draft_model_of_another_vocabulary_is_refused_at_construction(tiny_models, tmp_path):
    target = tiny_models[0]
    other = load_model(save_tiny(tmp_path / "d80", vocab=80, hidden=32, layers=1, heads=2, kv_heads=1, seed=3))
    cfg = SystemConfig(drafter="draft_model", tree="chain", nodes=4, depth=4)
    with pytest.raises(DrafterError, match=r"vocabulary \(80 ids\) does not fit the target's \(64 ids\)"):
        Engine(target, cfg, DraftModelDrafter(other, 2), eos_ids=[])


def test_a_block_drafter_reading_missing_target_layers_is_refused(tiny_models):
    target = tiny_models[0]
    cfg = dataclasses.replace(tiny_config(target), target_layers=[0, target.args.num_layers])
    with pytest.raises(DrafterError, match="reads target layers"):
        Engine(target, SystemConfig(drafter="block", tree="chain", nodes=4, depth=4),
               BlockDrafter(BlockNet(cfg), target), eos_ids=[])


def test_an_object_that_is_not_a_drafter_is_refused(tiny_models):
    class Legacy:  # the pre-protocol shape: propose(committed, depth) and no declared facts
        def reset(self):
            pass

        def propose(self, committed, depth):
            return None

    with pytest.raises(DrafterError, match="is not a drafter"):
        Engine(tiny_models[0], SystemConfig(), Legacy(), eos_ids=[])


def test_drafters_satisfy_the_protocol(tiny_models):
    target, small = tiny_models
    for d in (DraftModelDrafter(small, 2), BlockDrafter(BlockNet(tiny_config(target)), target)):
        assert isinstance(d, Drafter) and d.vocab_size == target.args.vocab_size and d.max_slots == 1
        with pytest.raises(DrafterError, match="slot 1"):
            d.propose([DraftRequest(1, [1, 2, 3], 2)])


def test_a_draft_model_never_drafts_past_its_own_context(tiny_dirs, monkeypatch):
    """A draft model of 20 positions in an engine of 512: it drafts fewer positions as it nears 20, then none
    (the step is a plain decode step), never feeding a position >= 20; the output equals greedy."""
    target = load_model(tiny_dirs[0])
    small = load_model(tiny_dirs[1])
    small.args = dataclasses.replace(small.args, max_position_embeddings=20)
    seen = []
    real = small.forward

    def spy(tokens, positions, *a, **kw):
        seen.append(int(positions.max()))
        return real(tokens, positions, *a, **kw)

    monkeypatch.setattr(small, "forward", spy)
    cfg = SystemConfig(drafter="draft_model", tree="chain", nodes=5, depth=5, top_k=1)
    drafter = DraftModelDrafter(small, 1, static=False)
    assert drafter.max_context == 20
    eng = Engine(target, cfg, drafter, eos_ids=[])
    for p in random_prompts(2, 64, length=10, seed=41):
        g = eng.generate(p, 30)
        assert g.tokens == ar_tokens(target, p, 30)
        assert max(g.rows) > 1  # it did draft before the limit
        assert g.rows[-1] == 1  # and not after it (the last steps run past 20 committed tokens)
    assert seen and max(seen) < 20


def test_a_block_drafter_past_4096_positions_equals_greedy(tiny_models):
    """A block drafter's context buffers grow with the request: a 4,100-token prompt drafts on (they were a fixed
    4,096 slots, and a longer context was a shape error)."""
    target = tiny_models[0]
    net = BlockNet(tiny_config(target))  # untrained: acceptance does not matter, only that drafting runs
    g = torch.Generator().manual_seed(43)
    prompt = torch.randint(0, 64, (4100,), generator=g).tolist()
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=6, depth=4, top_k=4)
    drafter = BlockDrafter(net, target)
    eng = Engine(target, cfg, drafter, eos_ids=[], max_len=4200)
    got = eng.generate(prompt, 12)
    ar = Engine(target, SystemConfig.ar(), None, eos_ids=[], max_len=4200).generate(prompt, 12).tokens
    assert got.tokens == ar
    assert max(got.rows) > 1 and drafter.ctx_k.shape[1] >= 4100 + 11

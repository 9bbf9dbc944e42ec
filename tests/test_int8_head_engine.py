"""The ``lm_head_int8`` engine mechanism (§4.1): config field, the target's greedy argmax through the certified
INT8 head (reference on the CPU, the Triton path in the interpreter), speculative == AR token for token in
float32 on the CPU, and the CUDA-graph path's flagged-row settlement (forced on the CPU)."""

from __future__ import annotations

import pytest
import torch

from .tritonutil import DEV

from specpilot.config import SystemConfig
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.model.checkpoint import load_model
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.errors import SpecPilotError
from specpilot.head.certified import CertifiedInt8Head, with_int8_head
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .conftest import random_prompts


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


def test_config_field_label_seal():
    old = {"drafter": "ngram", "drafter_path": None, "tree": "best_first", "nodes": 16, "depth": 10, "top_k": 4,
           "ngram_max": 4, "ngram_min": 1, "dtype": "float32"}
    cfg = SystemConfig(**old)
    assert cfg.lm_head_int8 is False
    # the seal recorded in results/pilot_cpu_bundled_2026-11-30/system.json (old seals unchanged)
    assert cfg.seal() == "4ce261a774d2041300beb3f5ce0164826f7bb232bb0fd98056778e8ad51f3820"
    on = cfg.apply({"lm_head_int8": True})
    assert on.seal() != cfg.seal() and on.delta(cfg) == {"lm_head_int8": True}
    assert on.label() == "ngram/best_first N=16 D=10 k=4 +int8head"
    assert SystemConfig.ar(lm_head_int8=True, w12=True).label() == "AR +w12 +int8head"


def test_with_int8_head_shares_weights_and_leaves_model(dep):
    t = dep.int8_target(dep.target)
    assert t is dep.int8_target(dep.target) and t is not dep.target
    assert dep.target.int8_head is None and isinstance(t.int8_head, CertifiedInt8Head)
    assert t.lm_head is dep.target.lm_head and t.model is dep.target.model
    with pytest.raises(SpecPilotError, match="another LM head"):
        with_int8_head(dep.target, CertifiedInt8Head(torch.randn(8, 4)))


@pytest.mark.parametrize("cfg", [
    SystemConfig.stock("ngram", lm_head_int8=True),
    SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=6, top_k=4, lm_head_int8=True),
    SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=6, top_k=2, lm_head_int8=True, w12=True),
], ids=lambda c: c.label())
def test_spec_equals_ar_bundled(dep, cfg):
    ids = dep.tokenizer("def fibonacci(n):\n    ", add_special_tokens=False)["input_ids"]
    plain = dep.system(SystemConfig.ar()).generate(ids, 24).tokens
    ar = dep.system(SystemConfig.ar(lm_head_int8=True, w12=cfg.w12))
    head = ar.target.int8_head
    before = head.stats.calls
    assert ar.generate(ids, 24).tokens == plain
    eng = dep.system(cfg)
    assert eng.target.int8_head is head
    assert eng.generate(ids, 24).tokens == plain, cfg.label()
    assert head.stats.calls > before and head.stats.survivors / head.stats.rows < 100


@pytest.mark.parametrize("buckets", [False, True])
def test_tiny_random_model_kernel_path(tiny_dirs, buckets):
    """The Triton path (interpreter) as the target's head on a tiny random model, eager and padded-bucket
    static passes: speculative == AR (both with the head) == the plain model's AR."""
    target, drafter = load_model(tiny_dirs[0], device=DEV), load_model(tiny_dirs[1], device=DEV)
    head = CertifiedInt8Head(target.lm_head.weight, use_kernel=True, capacity=16)
    t8 = with_int8_head(target, head)
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, lm_head_int8=True)
    for p in random_prompts(2, 64, length=8, seed=31):
        spec = Engine(t8, cfg, DraftModelDrafter(drafter, 2), eos_ids=[], buckets=buckets).generate(p, 8).tokens
        ar = Engine(t8, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        plain = Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        assert spec == ar == plain
    assert head.stats.calls > 0 and head.kernel() is not None


def test_flagged_graph_path_settles_flagged_rows(tiny_dirs):
    """The CUDA-graph form (``argmax_flagged``: ids and ``needs_full_head``; flagged rows settled from the pass's
    static hidden states by the full head), forced on the CPU with a kernel that flags every row and guesses token 0:
    outputs must not change."""
    target, drafter = load_model(tiny_dirs[0]), load_model(tiny_dirs[1])
    head = CertifiedInt8Head(target.lm_head.weight, use_kernel=False)
    calls = []

    class Flagging:  # a Triton path that never certifies a row and guesses token 0
        def __call__(self, h):
            calls.append(h.shape[0])
            return torch.zeros(h.shape[0], dtype=torch.long), torch.zeros(h.shape[0], dtype=torch.bool)

    head.kernel = lambda: Flagging()
    t8 = with_int8_head(target, head)
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, lm_head_int8=True)
    for p in random_prompts(2, 64, length=8, seed=37):
        eng = Engine(t8, cfg, DraftModelDrafter(drafter, 2), eos_ids=[], buckets=True)
        eng.runner.head_flags = True
        plain = Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        assert eng.generate(p, 8).tokens == plain
        flags = eng.runner.needs_full_head()  # the last pass's rows, every one flagged
        assert flags and all(flags)
    assert calls and set(calls) <= {1, 2, 4, 8}  # bucket-padded passes went through the flagged head


@pytest.mark.parametrize("flag_every", [1, 3])
def test_pipelined_ar_with_flagged_head_redoes_flagged_steps(tiny_dirs, flag_every):
    """Pipelined AR (steps queued ahead on device-fed tokens) with the INT8 head's flagged form, forced on the CPU
    with a kernel that flags every row (or every third call, else certifies the true argmax) and guesses a wrong
    (valid) id where it flags: a flagged step is redone and settled by the full head, so the output is the plain
    model's AR exactly."""
    target = load_model(tiny_dirs[0])
    head = CertifiedInt8Head(target.lm_head.weight, use_kernel=False)
    v, calls = target.args.vocab_size, []

    class SometimesFlagging:
        def __call__(self, h):
            calls.append(h.shape[0])
            true = torch.nn.functional.linear(h, target.lm_head.weight).float().argmax(-1)
            flag = torch.zeros_like(true, dtype=torch.bool) | (len(calls) % flag_every == 0)
            return torch.where(flag, (true + 1) % v, true), ~flag  # a flagged row's guess is wrong

    head.kernel = lambda: SometimesFlagging()
    t8 = with_int8_head(target, head)
    for p in random_prompts(2, 64, length=8, seed=41):
        eng = Engine(t8, SystemConfig.ar(lm_head_int8=True), None, eos_ids=[], buckets=True)
        eng.runner.head_flags = True
        assert eng._pipelined_ar(None)
        plain = Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(p, 12).tokens
        assert eng.generate(p, 12).tokens == plain
    assert calls.count(1) >= 2 * 11  # the pipelined one-row steps went through the flagged head

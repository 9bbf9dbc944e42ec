"""The bundled default models: transformers loads them as they are, greedy output there equals ours, and
speculative output equals AR on a subset of every bundled benchmark for both drafters and both builders."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import BENCHMARKS, load_requests
from specpilot.engine.deployment import Deployment
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


def prompt_ids(dep, bench, n):
    reqs = load_requests(bench, n, tokenizer=dep.tokenizer)
    return [dep.tokenizer(r.text, add_special_tokens=False)["input_ids"] for r in reqs]


def test_bundled_sizes_and_provenance():
    total = 0
    for d in (bundled_target_dir(), bundled_drafter_dir()):
        prov = json.loads((d / "provenance.json").read_text())
        for key in ("command", "seed", "steps", "final_train_loss", "git_commit", "data"):
            assert key in prov, (d, key)
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total < 30e6


def test_transformers_loads_bundled_target_and_greedy_matches(dep):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(bundled_target_dir()), dtype=torch.float32).eval()
    ids = prompt_ids(dep, "humaneval", 1)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    ours = dep.system(SystemConfig.ar()).generate(ids, 24).tokens
    # transformers stops at EOS like we do; compare up to its length
    assert ours[: len(ref)] == ref


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_spec_equals_ar_on_bundled_benchmarks(dep, bench):
    systems = [
        SystemConfig.stock("ngram"),
        SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=8, top_k=4),
        SystemConfig.stock("draft_model"),
        SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=6, top_k=4),
    ]
    for ids in prompt_ids(dep, bench, 2):
        ar = dep.system(SystemConfig.ar()).generate(ids, 40)
        for cfg in systems:
            assert dep.system(cfg).generate(ids, 40).tokens == ar.tokens, (bench, cfg.label())


def test_bundled_target_continues_plausibly(dep):
    """Not a loop of one token: the continuation of a GSM8K prompt uses many distinct tokens."""
    ids = prompt_ids(dep, "gsm8k", 1)[0]
    out = dep.system(SystemConfig.ar()).generate(ids, 48).tokens
    assert len(set(out)) >= 12

"""CUDA graphs per row bucket on a GPU (issue 4): every bucket a system can use is captured when it is built, so a
timed request never captures (a first-met bucket used to be captured mid-request, inside the controller's
timer); graphs captured at build on dummy inputs replay the same tokens as graphs captured mid-request on
the real ones. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.engine.graphs import BUCKETS
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cfg", [SystemConfig.stock("ngram"),
                                 SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=5, top_k=3),
                                 SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=5, top_k=3, w12=True)],
                         ids=["ngram", "draft_model_tree", "w12_ngram_tree"])  # w12: GEMV, word kernel, dense path in graphs
def test_all_buckets_captured_at_build_and_none_later(cfg):
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32", device="cuda")
    eng = dep.system(cfg)
    runners = [eng.runner] + ([eng.drafter.runner] if cfg.drafter == "draft_model" else [])
    assert all(sorted(r._graphs) == list(BUCKETS) for r in runners)  # verify / catch-up / prefill chunks
    graphs = [dict(r._graphs) for r in runners]
    lazy = dep.system(cfg)
    for r in [lazy.runner] + ([lazy.drafter.runner] if cfg.drafter == "draft_model" else []):
        r.drop_graphs()  # as before: each bucket captured when a request first meets it
    for prompt in ([5, 17, 300, 42, 9] * 8, [7] * 3, [11, 400, 23] * 100):  # the last: two prefill chunks
        assert eng.generate(prompt, 40).tokens == lazy.generate(prompt, 40).tokens
    assert [dict(r._graphs) for r in runners] == graphs  # the same graph objects: nothing captured since

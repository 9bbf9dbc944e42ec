"""Kernels a hybrid target's static verify pass launches, counted on the CPU: the aten compute ops (views and the
Triton interpreter's bookkeeping excluded) of one ``forward_static`` of the tiny 4-layer qwen3_5 of the tests (3 GDN
+ 1 attention layers, GDN path kernel in Triton's interpreter), per layer. A GPU pass launches about one kernel per
such op, so the count is what a graphed step pays per layer in launches (docs/hybrid.md: the step's excess over its
weight floor). Usage: ``TRITON_INTERPRET=1 PYTHONPATH=. python probes/hybrid_static_opcount.py OUT.json``."""

from __future__ import annotations

import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import tests.test_hybrid_static as T
import tests.tritonutil  # noqa: F401  (the interpreter's numpy fix)
from specpilot.provenance import git_commit, versions

#: aten ops that launch no kernel of their own (views, allocation, the interpreter's tensor bookkeeping)
NOT_KERNELS = {"aten::set_", "aten::to", "aten::empty", "aten::new_empty", "aten::select", "aten::reshape",
               "aten::unsqueeze", "aten::slice", "aten::view", "aten::as_strided", "aten::t", "aten::transpose",
               "aten::permute", "aten::expand", "aten::chunk", "aten::split", "aten::squeeze", "aten::detach",
               "aten::alias", "aten::lift_fresh", "aten::empty_strided", "aten::_to_copy", "aten::item",
               "aten::_local_scalar_dense", "aten::numpy_T", "aten::resolve_conj", "aten::resolve_neg"}


def main(out: str) -> None:
    t = T.load("qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16)
    parents, bucket = T.TREE, 8
    r, v = len(parents), t.args.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt, toks = torch.randint(0, v, (T.P,), generator=g), torch.randint(0, v, (r,), generator=g)
    anc = T.ancestors(parents, bucket)
    tk, ps = torch.zeros(bucket, dtype=torch.long), torch.full((bucket,), T.P)
    tk[:r], ps[:r] = toks, T.P + anc[:r, :r].sum(1) - 1
    with torch.inference_mode():
        c = T.prefilled(t, prompt)
        c.gdn_kernels = True
        for i in range(2):  # the second pass is the one counted (the first warms caches)
            c.begin_pass(T.P, r, bucket)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t.forward_static(tk, ps, c, torch.tensor(T.P), anc)
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    ops = collections.Counter(e.name for e in top if e.name not in NOT_KERNELS)
    layers = len(t.args.layer_types)
    res = {"what": __doc__.split("\n\n")[0], "device": "cpu (Triton interpreter for the GDN kernel)",
           "versions": versions(), "commit": git_commit(), "layer_types": t.args.layer_types, "rows": bucket,
           "compute_ops": sum(ops.values()), "compute_ops_per_layer": sum(ops.values()) / layers,
           "by_op": dict(ops.most_common()), "triton_launches_not_counted": "the GDN path kernel and root_paths"}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(res["compute_ops"], "compute ops,", round(res["compute_ops_per_layer"], 1), "a layer;", ops.most_common(8))


if __name__ == "__main__":
    main(sys.argv[1])

"""Kernels a hybrid target's static verify pass launches, counted on the CPU: the aten compute ops (views and the
Triton interpreter's bookkeeping excluded) of one ``forward_static`` of the tiny 4-layer qwen3_5 of the tests (3 GDN
+ 1 attention layers, GDN path kernel in Triton's interpreter), per layer. A GPU pass launches about one kernel per
such op, so the count is what a graphed step pays per layer in launches (docs/hybrid.md: the step's excess over its
weight floor). Each decoder layer runs inside a profiler region of its own, so the ops are also counted per layer
(``by_layer``) and per layer kind; the embedding, the mask / parents / conv index and the final norm fall outside
(``outside_layers``). Triton launches are not aten ops: they are counted apart (``triton_launches``, by kernel).
Usage: ``TRITON_INTERPRET=1 PYTHONPATH=. python probes/hybrid_static_opcount.py OUT.json``; to count an older
commit, run this file from an exported copy of that commit with ``SPECPILOT_COMMIT`` set (docs/hybrid.md)."""

from __future__ import annotations

import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import specpilot.model.hybrid_static as hs
import tests.test_hybrid_static as T
import tests.tritonutil  # noqa: F401  (the interpreter's numpy fix)
from specpilot.provenance import git_commit, versions

#: aten ops that launch no kernel of their own (views, allocation, the interpreter's tensor bookkeeping)
NOT_KERNELS = {"aten::set_", "aten::to", "aten::empty", "aten::new_empty", "aten::select", "aten::reshape",
               "aten::unsqueeze", "aten::slice", "aten::view", "aten::as_strided", "aten::t", "aten::transpose",
               "aten::permute", "aten::expand", "aten::chunk", "aten::split", "aten::squeeze", "aten::detach",
               "aten::alias", "aten::lift_fresh", "aten::empty_strided", "aten::_to_copy", "aten::item",
               "aten::_local_scalar_dense", "aten::numpy_T", "aten::resolve_conj", "aten::resolve_neg",
               "aten::empty_like", "aten::split_with_sizes"}


def layer_regions() -> list[str]:
    """Wrap :func:`hybrid_static._layer` so that each call runs in a profiler region ``layer<i>:<kind>``; returns
    the list the region names are appended to, in call order."""
    names, inner = [], hs._layer

    def wrapped(layer, *a, **kw):
        names.append(f"layer{len(names)}:{layer.kind}")
        with record_function(names[-1]):
            return inner(layer, *a, **kw)

    hs._layer = wrapped
    return names


def triton_launches() -> collections.Counter:
    """Count launches of every Triton kernel (``kernel[grid](...)``) in this process, by kernel name."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = collections.Counter()
    inner = InterpretedFunction.run

    def run(self, *a, **kw):
        seen[self.fn.__name__] += 1
        with record_function(f"triton:{self.fn.__name__}"):  # the interpreter's copies of the arguments fall in it
            return inner(self, *a, **kw)

    InterpretedFunction.run = run
    return seen


def main(out: str) -> None:
    t = T.load("qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16)
    parents, bucket = T.TREE, 8
    r, v = len(parents), t.args.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt, toks = torch.randint(0, v, (T.P,), generator=g), torch.randint(0, v, (r,), generator=g)
    anc = T.ancestors(parents, bucket)
    tk, ps = torch.zeros(bucket, dtype=torch.long), torch.full((bucket,), T.P)
    tk[:r], ps[:r] = toks, T.P + anc[:r, :r].sum(1) - 1
    names, launches = layer_regions(), triton_launches()
    with torch.inference_mode():
        c = T.prefilled(t, prompt)
        c.gdn_kernels = True
        for i in range(2):  # the second pass is the one counted (the first warms caches)
            c.begin_pass(T.P, r, bucket)
            names.clear()
            launches.clear()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t.forward_static(tk, ps, c, torch.tensor(T.P), anc)
    regions = set(names)
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.name not in NOT_KERNELS
           and (e.cpu_parent is None or e.cpu_parent.name in regions)]
    ops = collections.Counter(e.name for e in top)
    where = collections.Counter(e.cpu_parent.name if e.cpu_parent is not None else "outside_layers" for e in top)
    tri = [e for e in prof.events() if e.name.startswith("triton:")]
    tri_where = collections.Counter(e.cpu_parent.name if e.cpu_parent is not None else "outside_layers" for e in tri)
    kinds = collections.defaultdict(list)
    for n in names:
        kinds[n.split(":")[1]].append(where[n] + tri_where[n])
    layers = len(t.args.layer_types)
    res = {"what": __doc__.split("\n\n")[0], "device": "cpu (Triton interpreter for the kernels)",
           "versions": versions(), "commit": git_commit(), "layer_types": t.args.layer_types, "rows": bucket,
           "fused_projections": any("in_proj" in m._modules for m in t.modules()),
           "compute_ops": sum(ops.values()), "compute_ops_per_layer": sum(ops.values()) / layers,
           "by_layer": {n: {"aten": where[n], "triton": tri_where[n]} for n in names},
           "outside_layers": {"aten": where["outside_layers"], "triton": tri_where["outside_layers"]},
           "launches_per_layer_by_kind": {k: sum(v) / len(v) for k, v in kinds.items()},
           "by_op": dict(ops.most_common()),
           "by_layer_op": {n: dict(collections.Counter(e.name for e in top if e.cpu_parent is not None
                                                       and e.cpu_parent.name == n).most_common()) for n in names}, "triton_launches": dict(launches.most_common())}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(res["compute_ops"], "compute ops;", res["by_layer"], "outside", res["outside_layers"], "; triton",
          res["triton_launches"], "; launches a layer by kind", res["launches_per_layer_by_kind"])


if __name__ == "__main__":
    main(sys.argv[1])

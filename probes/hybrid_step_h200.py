"""A hybrid target's whole graphed verify step on one GPU: the Qwen3.5-27B-like shape (zoo ``qwen3.5-27b-like``: 64
layers, 48 Gated DeltaNet + 16 gated attention, hidden 5120), random bf16 weights built on the GPU (no checkpoint).

After a 512-token prompt (eager prefill, committed), for (a) a chain of 16 drafted tokens (17 rows) and (b) a 32-node
best-first-like tree of depth 8 (33 rows: a spine of 8 and side branches, more of them near the root; fixed seed),
each padded to the engine's row bucket (:data:`specpilot.engine.runner.BUCKETS`; 24 and 40) and also unpadded
(17 and 33 rows), timed with CUDA events (median of ``--reps`` replays, interleaved rounds, after warm-up):

- ``step``: one CUDA graph of the exact pass (:meth:`HybridTransformer.forward_static`), the greedy argmax over the
  LM head and the commit of an accepted path (:func:`~specpilot.model.hybrid_static.commit_path`: ``gdn_commit`` on
  all 48 GDN layers, the conv windows) — the device work of a verify step (no host read, no drafter, no K/V
  compaction: the accepted path is rows 0 … ``--accept`` − 1, in place in both shapes);
- ``pass``: the exact pass + argmax alone; ``commit``: the commit alone; ``gdn_kernel``: ``root_paths`` and the path
  kernel on all 48 GDN layers over the pass's recorded inputs (the delta-rule share of the pass, not its projections).

The state moves at every replay of a graph that commits (timing only; values stay bounded). Checked once per shape
before timing: the graphed pass's tokens equal the same static pass run eagerly (``tokens_equal``); also the share
of rows whose token the eager reference pass (:meth:`HybridTransformer.forward`) gives too (``eager_forward_agree``,
informational in bf16); the commit against the PyTorch reference replay of the same path from the same state
(``commit_vs_reference_max_abs``, all 48 layers). A shape that fails records its error and the others still run.
The figure the project wants: ``ratio_tree_over_chain`` = step(tree) / step(chain) ≤ 1.15 (paper §4.2).

Usage: ``SPECPILOT_COMMIT=$(git rev-parse --short HEAD) python probes/hybrid_step_h200.py OUT_DIR [--profile]`` on an H200 (under
7 minutes; about 60 GB of GPU memory). ``--smoke``: a tiny hybrid on the CPU (a 150-token prompt, so the chunked
prefill runs; reference GDN path, no graphs, wall clock: it checks that the script runs, its times mean nothing);
``--smoke --kernels``: the same through the GDN path and commit kernels in Triton's interpreter (the CUDA path's
code, slowly). Writes ``OUT_DIR/run.json`` (``smoke.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv and "--kernels" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import torch  # noqa: E402

from specpilot.engine.runner import BUCKETS, bucket_for  # noqa: E402
from specpilot.kernels.gdn_tree import gdn_commit_reference, gdn_tree, root_paths  # noqa: E402
from specpilot.model.args import ModelArgs, rope_inv_freq  # noqa: E402
from specpilot.model.cache import PassKind  # noqa: E402
from specpilot.model.hybrid import HybridTransformer  # noqa: E402
from specpilot.model.hybrid_static import commit_path  # noqa: E402
from specpilot.provenance import git_commit, versions  # noqa: E402
from specpilot.zoo.random_ckpt import ARCHS  # noqa: E402

SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


def bf_tree(n: int, depth: int, seed: int = 0) -> list[int]:
    """Parents of a best-first-like tree of ``n`` rows: row 0 the root, a spine of ``depth`` rows below it (rows
    1 … depth), the others hung below random rows of depth < ``depth``, favouring shallow ones. Parents first."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths = list(range(-1, depth)), list(range(depth + 1))
    while len(parents) < n:
        ok = [j for j in range(len(parents)) if depths[j] < depth]
        w = torch.tensor([0.6 ** depths[j] for j in ok])
        p = ok[int(torch.multinomial(w, 1, generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


def build(cfg: dict, dev: str, dtype: torch.dtype) -> HybridTransformer:
    """The hybrid target of ``cfg`` with random weights made on ``dev`` (no init pass, no checkpoint): N(0, 0.02)
    matrices, norm weights at their identity (zero-centred 0, the GDN output norm 1), ``A_log`` 0, ``dt_bias`` 1."""
    args = ModelArgs.from_hf(cfg)
    with torch.device("meta"):
        model = HybridTransformer(args, verify="replay")
    model = model.to(dtype).to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 if "linear_attn.norm" in name else 0.0)
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(args).to(dev)
    return model.eval().requires_grad_(False).fuse_projections()  # as load_model does (results before 30b8cfe: unfused)


class Shape:
    """Static inputs of one verified shape: ``r`` real rows (``parents``) padded to ``b`` rows."""

    def __init__(self, model, cache, parents: list[int], b: int, start: int, accept: int, dev: str):
        r = len(parents)
        anc = torch.eye(b, dtype=torch.bool)
        depth = [0] * r
        for j, p in enumerate(parents):
            if p >= 0:
                anc[j] |= anc[p]
                depth[j] = depth[p] + 1
        gen = torch.Generator().manual_seed(b)
        tokens = torch.zeros(b, dtype=torch.long)
        tokens[:r] = torch.randint(0, model.args.vocab_size, (r,), generator=gen)
        positions = torch.full((b,), start, dtype=torch.long)
        positions[:r] += torch.tensor(depth)
        rows = torch.full((b,), -1, dtype=torch.int32)
        accept = min(accept, r)  # a one-row (AR) step commits its row
        rows[:accept] = torch.arange(accept, dtype=torch.int32)  # rows 0 .. accept − 1: a path in both shapes
        self.model, self.cache, self.r, self.b = model, cache, r, b
        self.tokens, self.positions, self.mask = tokens.to(dev), positions.to(dev), anc.to(dev)
        self.start, self.rows = torch.tensor(start, device=dev), rows.to(dev)
        self.depth = max(depth)

    def exact_pass(self) -> torch.Tensor:
        m = self.model
        return m.greedy(m.forward_static(self.tokens, self.positions, self.cache, self.start, self.mask))

    def eager_forward_agree(self, static_ids: torch.Tensor) -> float:
        """Share of the real rows whose argmax from the eager reference pass (``INSPECT``: nothing written) equals the
        static pass's ``static_ids [b]`` (informational: in bf16 the two sum in different orders)."""
        m, r, start = self.model, self.r, int(self.start)
        mask = torch.ones(r, start + r, dtype=torch.bool, device=self.mask.device)
        mask[:, start:] = self.mask[:r, :r]
        hidden = m.forward(self.tokens[:r], self.positions[:r], self.cache, start, mask, kind=PassKind.INSPECT)
        return float((m.greedy(hidden) == static_ids[:r]).float().mean())

    def commit_error(self) -> float:
        """Max |difference| between one eager :meth:`commit` (the state moves) and the PyTorch reference replay
        (:func:`gdn_commit_reference`) of the same path from the same state, over every GDN layer."""
        c, rec = self.cache, self.cache.static_record(self.b)
        ref = gdn_commit_reference(c.state.clone(), rec.k, rec.v, rec.g, rec.beta, self.rows)
        self.commit()
        return float((c.state - ref).abs().max())

    def commit(self) -> None:
        c = self.cache
        commit_path(c.state, c.window, c.static_record(self.b), self.rows, c.gdn_kernels)

    def step(self) -> torch.Tensor:
        out = self.exact_pass()
        self.commit()
        return out

    def gdn_kernel(self) -> None:
        c, rec = self.cache, self.cache.static_record(self.b)
        paths = root_paths(self.parents_i32)
        for layer in range(c.state.shape[0]):
            gdn_tree(c.state[layer], rec.k[layer], rec.k[layer], rec.v[layer], rec.g[layer], rec.beta[layer],
                     paths=paths)


def capture(fn, cuda: bool):
    """``(replay, output)``: a CUDA graph of ``fn`` (warmed up on a side stream first) and the output tensor its
    replays write; on the CPU ``(fn, None)``."""
    if not cuda:
        return fn, None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()
    return g.replay, res


def timed(run, n: int, cuda: bool) -> list[float]:
    """``n`` times (ms) of ``run()``: CUDA events around each call on CUDA, wall clock on the CPU."""
    if not cuda:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            run()
            out.append(1e3 * (time.perf_counter() - t0))
        return out
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def summary(ts: list[float]) -> dict:
    s = sorted(ts)
    return {"median_ms": statistics.median(s), "p10_ms": s[len(s) // 10], "p90_ms": s[(9 * len(s)) // 10],
            "n": len(s)}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--smoke", action="store_true", help="tiny hybrid on the CPU (checks the script runs)")
    ap.add_argument("--kernels", action="store_true", help="with --smoke: the GDN kernels in Triton's interpreter")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=60, help="timed replays per figure (in 5 interleaved rounds)")
    ap.add_argument("--accept", type=int, default=9, help="rows of the committed path (root + accepted drafts)")
    ap.add_argument("--wy", action="store_true", help="GDN layers verified by the WY kernel (KernelConfig.gdn_wy; "
                    "the gdn_kernel figure stays the path kernel's)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager run of the 32-node tree's bucketed pass (torch.profiler, CUDA "
                         "kernels by total time) into OUT_DIR/profile.txt, and time a one-row (AR) step")
    a = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = {**ARCHS["qwen3.5-27b-like"], **(SMOKE if a.smoke else {})}
    prompt_len, reps = (150, 1 if a.kernels else 5) if a.smoke else (a.prompt, a.reps)  # 150: the chunked prefill
    if a.smoke and a.kernels:
        import numpy as np
        from triton.runtime import interpreter as it

        if np.lib.NumpyVersion(np.__version__) >= "2.4.0":  # Triton 3.6's interpreter vs numpy 2.4 (conftest.py)
            orig = it._patch_lang_tensor

            def patched(tensor, scope):
                orig(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
            it._patch_lang_tensor = patched
    model = build(cfg, dev, dtype)
    if a.wy:
        model.kernels = dataclasses.replace(model.kernels, gdn_wy=True)
    n_params = sum(p.numel() for p in model.parameters())
    cache = model.new_cache(prompt_len + BUCKETS[-1] + 64)
    if a.smoke and a.kernels:
        cache.gdn_kernels = True  # the interpreter runs the CUDA path's kernels on the CPU
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.args.vocab_size, (prompt_len,), generator=gen).to(dev)
    t0 = time.perf_counter()
    model.forward(prompt, torch.arange(prompt_len, device=dev), cache, 0)
    cache.commit(prompt_len)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    trees = {"chain16": list(range(-1, 16)), "tree32": bf_tree(33, 8)}
    if a.profile:
        trees["ar1"] = [-1]  # one row: the AR step the speculative steps are priced against
    shapes = {}
    for name, parents in trees.items():
        for padded in ((True,) if len(parents) == 1 else (True, False)):
            b = bucket_for(len(parents)) if padded else len(parents)
            s = Shape(model, cache, parents, b, prompt_len, a.accept, dev)
            s.parents_i32 = torch.tensor(parents + [-1] * (b - len(parents)), dtype=torch.int32, device=dev)
            shapes[f"{name}/{'bucket' if padded else 'exact'}{b}"] = s
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke: no graphs, GDN " +
           ("kernels in the Triton interpreter)" if cache.gdn_kernels else "reference path)"),
           "versions": versions(), "commit": git_commit(), "arch": "qwen3.5-27b-like" + (" (smoke: shrunk)" if
                                                                                        a.smoke else ""),
           "dtype": str(dtype), "gdn_wy": model.kernels.gdn_wy, "params": n_params, "prompt_tokens": prompt_len,
           "accepted_rows": a.accept,
           "gdn_kernels": cache.gdn_kernels, "prefill_eager_s": prefill_s, "trees": trees, "shapes": {}}
    runs = {}
    for key, s in shapes.items():  # check the graphed pass against the same pass run eagerly, then capture the rest
        rec = out["shapes"][key] = {"rows": s.r, "bucket": s.b, "depth": s.depth}
        try:
            eager = s.exact_pass().clone()
            rec["eager_forward_agree"] = s.eager_forward_agree(eager)
            run, res = capture(s.exact_pass, cuda)
            graphed = run() if res is None else (run(), res)[1]
            rec["tokens_equal"] = bool(torch.equal(graphed[: s.r], eager[: s.r]))
            rec["commit_vs_reference_max_abs"] = s.commit_error()
            runs[key] = {"pass": run, "commit": capture(s.commit, cuda)[0], "step": capture(s.step, cuda)[0]}
            if cache.gdn_kernels:
                runs[key]["gdn_kernel"] = capture(s.gdn_kernel, cuda)[0]
        except Exception as e:  # noqa: BLE001  (a failed shape is reported in the JSON, the others still run)
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            runs.pop(key, None)
    times = {key: {k: [] for k in r} for key, r in runs.items()}
    rounds, warm = (1, 0) if a.smoke and a.kernels else (5, 3)  # the interpreter runs a kernel slowly
    for _ in range(rounds):  # interleaved rounds
        for key, r in runs.items():
            for k, run in r.items():
                for _ in range(warm):
                    run()  # warm-up of this figure in this round
                times[key][k] += timed(run, max(reps // rounds, 1), cuda)
    for key, t in times.items():
        out["shapes"][key].update({k: summary(v) for k, v in t.items()})
    sh = out["shapes"]
    for kind in ("bucket", "exact"):
        c = next(k for k in sh if k.startswith("chain16/" + kind))
        t = next(k for k in sh if k.startswith("tree32/" + kind))
        out[f"ratio_tree_over_chain_{kind}"] = {
            k: sh[t][k]["median_ms"] / sh[c][k]["median_ms"] for k in ("step", "pass", "commit", "gdn_kernel")
            if k in sh[t] and k in sh[c]}
    out["target_ratio"] = 1.15
    step = out["ratio_tree_over_chain_bucket"].get("step")
    out["target_met_bucket"] = None if step is None else step <= 1.15
    if cuda:
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    path = Path(a.out_dir)
    path.mkdir(parents=True, exist_ok=True)
    key = next((k for k in shapes if k.startswith("tree32/bucket")), None)
    if a.profile and key is not None:  # where the step's time goes beyond its weights
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        shapes[key].exact_pass()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                shapes[key].exact_pass()
            if cuda:
                torch.cuda.synchronize()
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (path / "profile.txt").write_text(f"{key}, 3 eager runs of the exact pass + argmax, sorted by {sort}\n{table}\n")
        out["profile"] = {"shape": key, "file": "profile.txt", "runs": 3}
    out["wall_s"] = time.perf_counter() - t_start
    (path / ("smoke.json" if a.smoke else "run.json")).write_text(json.dumps(out, indent=1) + "\n")
    for key, r in sh.items():
        print(key, {k: round(v["median_ms"], 3) for k, v in r.items() if isinstance(v, dict)},
              "tokens_equal", r.get("tokens_equal"), "eager_forward_agree", r.get("eager_forward_agree"),
              r.get("error", ""))
    print("ratio tree/chain", out["ratio_tree_over_chain_bucket"], out["ratio_tree_over_chain_exact"])


if __name__ == "__main__":
    main()

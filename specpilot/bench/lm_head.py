"""Certified INT8 LM head (§4.1) on the GPU: correctness, then bf16 head vs certified head.

    specpilot bench --suite lm-head --out DIR                 # CUDA: DIR/lm_head_bench_cuda_<date>.json
    specpilot bench --suite lm-head --device cpu --out DIR    # CPU smoke test (Triton interpreter, tiny)

1. Correctness (random bf16 weights N(0, 0.02) with planted duplicate and 1-ulp near-duplicate rows):
   ``CertifiedInt8Head.argmax`` (the Triton path; flagged rows through the full head) must equal
   ``argmax(F.linear(h, W).float())`` on every row of ~200 hidden states in batches of R: pure random h (the
   Cauchy-Schwarz bound is loose for them: many survivors, flagged rows expected), "peaked" h
   (``noise + gamma * W_j`` scaled: a winner gamma * sqrt(K) sigmas above the rest, like an LM's top logit)
   and h aimed at the planted ties. Per kind: mismatches (must be 0), kernel-certified rate, survivors.
   Optionally (``--bundled``) the bundled target's head on its own hidden states.
2. Timing at R = 1, 8, 16, 32, 64 (peaked h): µs per call of ``F.linear(h, W).argmax(-1)`` (bf16, cuBLAS)
   and of the certified head as the engine's CUDA-graph path calls it (``argmax_flagged``: bounds kernel +
   threshold + selection + float64 rescoring, no host sync), and of the bounds kernel alone; each from one
   captured CUDA graph of ``reps`` calls on distinct h (a bank of fresh inputs), timed with CUDA events,
   best of 5 replays. The weights (1.2 GB bf16, 0.6 GB int8) exceed L2 many times over, so every call
   streams them from HBM. Also: survivor counts and the kernel's flagged-row rate on those inputs (flagged
   rows cost one full bf16 head on top, outside the graph).
3. Sweep of bounds-kernel launch configs at R = 1 and 32 (each checked against the default's tokens).

Every section is wrapped: a failing variant records its error and the run goes on; OUT.json is written
after every section. Device, versions, commit (SPECPILOT_COMMIT or git) are recorded.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from specpilot.head.bound import fp32_reduction
from specpilot.head.certified import CertifiedInt8Head

ROWS = (1, 8, 16, 32, 64)


def meta(args) -> dict:
    """Device, versions and commit of this run."""
    from specpilot.provenance import git_commit

    out = {"args": vars(args), "python": platform.python_version(), "torch": torch.__version__,
           "commit": git_commit(), "device": "cpu (Triton interpreter)" if args.quick else torch.cuda.get_device_name()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"missing: {e}"
    return out


def weights(v: int, k: int, dev: str, seed: int = 0):
    """Random bf16 head ``[v, k]`` N(0, 0.02) with planted ties: rows (10, 20) exact duplicates, (30, 40) equal
    but for one element one bf16 ulp apart. Returns ``(W, tie_pairs)``."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w = (torch.randn(v, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    w[20] = w[10]
    w[40] = w[30]
    w[40, 7] = torch.nextafter(w[30, 7].float(), torch.tensor(1.0, device=dev)).to(torch.bfloat16)
    if w[40, 7] == w[30, 7]:  # the float32 nextafter rounded back: step one bf16 ulp by hand
        w[40, 7] = (w[30, 7].view(torch.int16) + 1).view(torch.bfloat16)
    return w, [(10, 20), (30, 40)]


def hidden(kind: str, n: int, w: torch.Tensor, g: torch.Generator, gamma: float = 0.1) -> torch.Tensor:
    """``n`` hidden states ``[n, K]`` bf16: ``random`` (N(0, 1)), ``peaked`` (noise + gamma * ||noise|| *
    W_j / ||W_j|| for random j) or ``tie`` (aimed at the planted pairs, with a little noise)."""
    v, k = w.shape
    dev = w.device
    noise = torch.randn(n, k, generator=g, device=dev)
    if kind == "random":
        return noise.to(torch.bfloat16)
    if kind == "peaked":
        j = torch.randint(0, v, (n,), generator=g, device=dev)
    else:
        j = torch.tensor([10, 30], device=dev).repeat((n + 1) // 2)[:n]
        gamma = 1.0
    wj = w[j].float()
    h = noise + gamma * noise.norm(dim=1, keepdim=True) * wj / wj.norm(dim=1, keepdim=True)
    return h.to(torch.bfloat16)


def correctness(head: CertifiedInt8Head, w, n: int, batch: int, dev: str) -> dict:
    """Mismatches of the certified head vs the exact head over ``n`` h per kind, in batches of ``batch``."""
    g = torch.Generator(device=dev).manual_seed(1)
    kern = head.kernel()
    out = {}
    for kind, gamma in (("random", 0.0), ("peaked", 0.05), ("peaked", 0.1), ("peaked", 0.2), ("tie", 1.0)):
        name = kind if kind != "peaked" else f"peaked_gamma{gamma}"
        mism = certified = rows = 0
        surv = []
        for s in range(0, n, batch):
            h = hidden(kind, min(batch, n - s), w, g, gamma)
            ref = F.linear(h, w).float().argmax(-1)
            tok, ok = kern(h)
            surv.append(kern.last_survivors.clone())
            certified += int(ok.sum())
            mism += int((tok[ok] != ref[ok]).sum())  # certified rows must already be exact
            mism += int((head.argmax(h) != ref).sum())  # and the whole call, flagged rows settled
            rows += h.shape[0]
        sv = torch.cat(surv).float()
        out[name] = {"rows": rows, "mismatches": mism, "certified_rate": certified / rows,
                     "survivors_median": float(sv.median()), "survivors_mean": float(sv.mean()),
                     "survivors_max": int(sv.max()), "over_capacity_rate": float((sv > kern.capacity).float().mean())}
    return out


def time_graph(fn, bank: torch.Tensor, quick: bool) -> float:
    """µs per ``fn(h)`` over the h of ``bank [reps, R, K]``: one CUDA graph of all calls, best of 5 replays
    (CUDA events); in ``quick`` mode a wall-clock loop on the CPU."""
    if quick:
        t = time.perf_counter()
        for h in bank:
            fn(h)
        return (time.perf_counter() - t) * 1e6 / len(bank)
    from specpilot.bench.timing import time_graph as graph_us

    return graph_us([lambda h=h: fn(h) for h in bank])


def timing(head: CertifiedInt8Head, w, rows, reps: int, quick: bool, dev: str) -> dict:
    """bf16 head vs certified head (and its bounds kernel alone) per R (module docstring, section 2)."""
    g = torch.Generator(device=dev).manual_seed(2)
    kern = head.kernel()
    out = {}
    for r in rows:
        res = {}
        try:
            bank = torch.stack([hidden("peaked", r, w, g, 0.1) for _ in range(reps)])
            tok, ok = kern(bank[0])
            res["certified_rate"] = float(ok.float().mean())
            res["survivors_max"] = int(kern.last_survivors.max())
            res["bf16_us"] = time_graph(lambda h: F.linear(h, w).argmax(-1), bank, quick)
            res["certified_us"] = time_graph(head.argmax_flagged, bank, quick)
            res["bounds_kernel_us"] = time_graph(lambda h: kern.bounds(h), bank, quick)
            res["speedup"] = res["bf16_us"] / res["certified_us"]
        except Exception as e:  # noqa: BLE001 - record and go on
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc(limit=4)
        out[str(r)] = res
        print(f"R={r}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in res.items() if k != "traceback"), flush=True)
    return out


def sweep(head: CertifiedInt8Head, w, reps: int, quick: bool, dev: str) -> list:
    """Bounds-kernel configs at R = 1 and 32: µs of the whole certified call and whether tokens match."""
    from specpilot.head.kernel import Int8HeadKernel

    variants = [dict(block_v=bv, block_k=bk, num_warps=nw, num_stages=ns)
                for bv, bk, nw, ns in ((64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 3),
                                       (64, 64, 4, 5), (64, 128, 8, 4), (128, 128, 8, 3), (32, 256, 4, 4))]
    if quick:
        variants = variants[:2]
    g = torch.Generator(device=dev).manual_seed(3)
    out = []
    for r in (1, 32):
        bank = torch.stack([hidden("peaked", r, w, g, 0.1) for _ in range(reps)])
        ref = F.linear(bank[0], w).float().argmax(-1)
        for cfg in variants:
            row = {"rows": r, **cfg}
            try:
                kern = Int8HeadKernel(head, head.capacity, **cfg)
                tok, ok = kern(bank[0])
                row["tokens_ok"] = bool((tok[ok] == ref[ok]).all())
                row["certified_us"] = time_graph(lambda h: kern(h), bank, quick)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            out.append(row)
            print("sweep", row, flush=True)
    return out


def bundled(dev: str) -> dict:
    """The bundled target's head (V 4096, H 256) on its own hidden states: mismatches and survivors."""
    from specpilot.model.checkpoint import load_model, load_tokenizer
    from specpilot.zoo import bundled_target_dir

    model = load_model(bundled_target_dir(), dtype="bfloat16", device=dev)
    tok = load_tokenizer(bundled_target_dir())
    text = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
            "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:")
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], device=dev)
    with torch.inference_mode():
        hid = model(ids, torch.arange(len(ids), device=dev), model.new_cache(len(ids)), 0)
        head = CertifiedInt8Head(model.lm_head.weight, use_kernel=True)
        t, ok = head.kernel()(hid)
        ref = model.logits(hid).argmax(-1)
        return {"rows": len(ids), "mismatches": int((head.argmax(hid) != ref).sum()) + int((t[ok] != ref[ok]).sum()),
                "certified_rate": float(ok.float().mean()),
                "survivors_mean": float(head.kernel().last_survivors.float().mean())}


def main(argv: list[str] | None = None) -> int:
    """Command line as documented in the module docstring (``argv`` default: ``sys.argv[1:]``); exit status 0
    when every correctness check passed, 1 otherwise, 2 without CUDA (and without ``--quick``). ``--quick``
    needs ``TRITON_INTERPRET=1`` set before Triton is first imported (``specpilot bench --suite lm-head --device
    cpu`` does that)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test in the Triton interpreter (tiny shapes)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--n", type=int, default=200, help="hidden states per kind in the correctness check")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph (distinct h)")
    ap.add_argument("--bundled", action="store_true", help="also check the bundled target's head")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.n, args.reps = min(args.vocab, 1000), min(args.hidden, 64), min(args.n, 16), 2
        dev, rows = "cpu", (1, 4)
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA GPU here (use --quick for the CPU smoke test)", file=sys.stderr)
            return 2
        dev, rows = "cuda", ROWS
    with fp32_reduction(dev):  # the bound's reference GEMMs reduce in float32; the flags restored after the run
        return _run(args, dev, rows)


def _run(args, dev: str, rows) -> int:
    result = {"meta": meta(args)}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save()
    w, _ = weights(args.vocab, args.hidden, dev)
    t0 = time.perf_counter()
    head = CertifiedInt8Head(w, use_kernel=True, capacity=args.capacity)
    result["build_s"] = time.perf_counter() - t0
    sections = [("correctness", lambda: correctness(head, w, args.n, 8 if args.quick else 64, dev)),
                ("timing", lambda: timing(head, w, rows, args.reps, args.quick, dev))]
    if not args.no_sweep:
        sections.append(("sweep", lambda: sweep(head, w, args.reps, args.quick, dev)))
    if args.bundled:
        sections.append(("bundled", lambda: bundled(dev)))
    for name, fn in sections:
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
        print(name, json.dumps(result[name])[:2000], flush=True)
        save()
    bad = result.get("correctness", {})
    mism = sum(v.get("mismatches", 0) for v in bad.values() if isinstance(v, dict))
    result["correct"] = "error" not in bad and mism == 0
    save()
    print(f"wrote {args.out}; correct: {result['correct']}")
    return 0 if result["correct"] else 1


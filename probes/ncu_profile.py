"""Nsight Compute profiles of the kernels that miss the 1.25x W12 goal: W12 vs cuBLAS on the Qwen3-8B projections (qkv, o,
gate_up, down) at 1 / 8 / 16 / 32 rows, and the certified INT8 head (bounds, select, rescore, decide) vs the bf16 head
at 1 row.

    python probes/ncu_profile.py OUT.json                 # runs ncu once per case (34 cases), writes every metric as JSON
    python probes/ncu_profile.py OUT.json --cases w12-qkv-1,head-int8-1

Each case runs in its own process under ``ncu --clock-control none --nvtx --nvtx-include measure/`` (the device
notes: ncu reads the counters on the Firecracker H200s, and the clocks are left alone), with the sections
SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis, Occupancy, LaunchStats, WarpStateStats and
SchedulerStats; only the kernels launched inside the ``measure`` NVTX range are profiled (the warm-up, compiles
and weight set-up are not). ``--page details --csv`` is parsed into ``{case: {kernels: [{kernel, grid, block,
metrics: {section: {name: [unit, value]}}}], summary}}``, the summary holding the kernels' summed ``Duration``
and each kernel's DRAM throughput, issue slots busy, eligible-warp share and achieved occupancy. ncu
replays every kernel several times and serialises them, so its durations are of an isolated kernel, not of a
CUDA-graph replay: read the percentages (DRAM throughput of peak, issue slots busy, achieved occupancy, warp
stall reasons), and take the speed from ``specpilot bench --suite w12`` / ``--suite lm-head``.

Without ``ncu`` (the CPU machines) the script says so and exits 2; ``--parse FILE.csv`` parses a saved ncu
CSV (tests).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # Qwen3-8B, (N, K)
CASES = [f"{impl}-{proj}-{rows}" for proj in SHAPES for rows in (1, 8, 16, 32) for impl in ("w12", "cublas")]
CASES += ["head-int8-1", "head-bf16-1"]
#: GDN tree verification at the Qwen3.5-27B-like GDN shape (48 value heads of 128), the 32-node best-first tree of
#: probes/gdn_wy_h200.py: the path kernel and the WY kernel on one layer, and the WY kernel on all 48 layers in one launch
CASES += ["gdn-path-32", "gdn-wy-32", "gdn-wyall-32"]
HEAD = (151936, 4096)  # Qwen3-8B LM head (V, K)


def parse_details(text: str) -> list[dict]:
    """ncu ``--csv --page details`` output -> one dict per profiled kernel, in launch order:
    ``{"id", "kernel", "grid", "block", "metrics": {section: {metric: [unit, value]}}}`` (values as float where
    they parse, else str). ncu's own ``==PROF==`` / ``==WARNING==`` lines, before or among the rows, are skipped.
    Raises ValueError when no header is found."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in the output")
    kernels: dict[str, dict] = {}
    body = [ln for ln in lines[start:] if ln.startswith('"')]  # ncu's ==PROF== / ==WARNING== lines interleave
    for row in csv.DictReader(io.StringIO("\n".join(body))):
        k = kernels.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row.get("Kernel Name", ""),
                                           "grid": row.get("Grid Size", ""), "block": row.get("Block Size", ""),
                                           "metrics": {}})
        raw = (row.get("Metric Value") or "").replace(",", "")
        try:
            val: float | str = float(raw)
        except ValueError:
            val = raw
        k["metrics"].setdefault(row.get("Section Name", ""), {})[row.get("Metric Name", "")] = [row.get("Metric Unit", ""), val]
    return [kernels[i] for i in sorted(kernels, key=int)]


def summary(kernels: list[dict]) -> dict:
    """Per case: kernels, total duration (µs, from SpeedOfLight's Duration in any unit ncu chose), and each
    kernel's DRAM throughput % of peak, issue slots busy % (Compute Workload Analysis), cycles with an eligible
    warp % (Scheduler Statistics: "One or More Eligible") and achieved occupancy %, where ncu reported them
    (None otherwise)."""
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    total, rows = 0.0, []
    for k in kernels:
        sol = k["metrics"].get("GPU Speed Of Light Throughput", {})
        dur = sol.get("Duration")
        us = dur[1] * scale.get(dur[0], float("nan")) if dur and isinstance(dur[1], float) else None
        total += us or 0.0
        pick = lambda sec, name: (k["metrics"].get(sec, {}).get(name) or [None, None])[1]  # noqa: E731
        rows.append({"kernel": k["kernel"][:80], "us": us, "dram_pct": pick("GPU Speed Of Light Throughput", "DRAM Throughput"),
                     "issue_busy_pct": pick("Compute Workload Analysis", "Issue Slots Busy"),
                     "eligible_pct": pick("Scheduler Statistics", "One or More Eligible"),
                     "achieved_occupancy_pct": pick("Occupancy", "Achieved Occupancy"),
                     "registers": pick("Launch Statistics", "Registers Per Thread"), "grid": k["grid"]})
    return {"kernels": len(kernels), "total_us": total, "per_kernel": rows}


def run_case(case: str) -> None:
    """Set up ``case`` on the GPU, warm it up, then launch it once inside the NVTX range ``measure``.
    Raises SystemExit (one line) without CUDA or for an unknown case."""
    import torch
    import torch.nn.functional as F

    if case not in CASES:
        raise SystemExit(f"ncu_profile: unknown case {case!r}")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_profile: --run-case needs a CUDA GPU")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    if case.startswith("gdn-"):
        fn = gdn_case(case)
    elif case.startswith("head-"):
        from specpilot.head.certified import CertifiedInt8Head

        v, k = HEAD
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the certified head needs
        w = (torch.randn(v, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        h = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
        if case == "head-int8-1":
            kern = CertifiedInt8Head(w, use_kernel=True).kernel()
            fn = lambda: kern(h)  # noqa: E731
        else:
            fn = lambda: F.linear(h, w).argmax(-1)  # noqa: E731
    else:
        impl, proj, rows = case.split("-")
        n, k = SHAPES[proj]
        w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        x = torch.randn(int(rows), k, generator=g, device=dev).to(torch.bfloat16)
        if impl == "w12":
            from specpilot.w12.gemm import escape_table, w12_gemm
            from specpilot.w12.format import encode

            t = encode(w, device=dev)
            esc = escape_table(t)
            fn = lambda: w12_gemm(x, t, escapes=esc)  # noqa: E731
        else:
            fn = lambda: F.linear(x, w)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def gdn_case(case: str):
    """The launch of a ``gdn-*`` case, its inputs made and its root paths / tree mask computed beforehand."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gdn_wy_h200 as g  # noqa: E402  (a sibling probe: its tree and input makers)
    from specpilot.kernels.gdn_tree import gdn_tree, root_paths
    from specpilot.kernels.gdn_wy import gdn_tree_wy, tree_mask

    gen = torch.Generator().manual_seed(0)
    parents = g.TREES["bf32"]
    s0 = (torch.randn(g.LAYERS, g.H, g.DK, g.DV, generator=gen) * 0.1).to("cuda")
    inp = g.make_inputs(gen, len(parents))
    par = torch.tensor(parents, dtype=torch.int32, device="cuda")
    paths, mask = root_paths(par), tree_mask(par)
    if case == "gdn-path-32":
        return lambda: gdn_tree(s0[0], *(t[0] for t in inp), paths=paths)
    if case == "gdn-wy-32":
        return lambda: gdn_tree_wy(s0[0], *(t[0] for t in inp), mask=mask)
    return lambda: gdn_tree_wy(s0, *inp, mask=mask)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0].replace("\n", " "))
    ap.add_argument("out", nargs="?")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument("--run-case", help=argparse.SUPPRESS)  # the child process under ncu
    ap.add_argument("--parse", help="parse a saved ncu --csv --page details file and print the JSON")
    a = ap.parse_args()
    if a.run_case:
        run_case(a.run_case)
        return 0
    if a.parse:
        try:
            ks = parse_details(Path(a.parse).read_text())
        except (OSError, ValueError) as e:
            print(f"error: cannot parse {a.parse}: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"kernels": ks, "summary": summary(ks)}, indent=1))
        return 0
    if not a.out:
        ap.error("OUT.json is required")
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; known: {CASES}")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists():
        print("error: ncu (Nsight Compute) is not installed here; run this on the GPU machine", file=sys.stderr)
        return 2
    from specpilot.provenance import git_commit, versions

    res = {"commit": git_commit(), "versions": versions(), "method": __doc__.strip().split("\n\n")[0].replace("\n", " "),
           "ncu": subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:],
           "sections": SECTIONS, "cases": {}}
    for case in cases:
        cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "measure/", "--csv", "--page", "details"]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, os.path.abspath(__file__), "--run-case", case]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            entry: dict = {"returncode": p.returncode}
            ks = parse_details(p.stdout)
            entry.update(summary=summary(ks), kernels=ks)
        except subprocess.TimeoutExpired as e:  # record it and go on with the other cases
            entry = {"error": f"ncu ran past {e.timeout} s"}
        except ValueError as e:
            entry.update(error=str(e), stdout_tail=p.stdout[-2000:], stderr_tail=p.stderr[-2000:])
        res["cases"][case] = entry
        print(case, json.dumps(entry.get("summary", entry.get("error")))[:600], flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The batched tree attention with keys walked in position-aligned blocks (``kernels/batch_attention.py``, "Aligned
to AR") against the kernel it replaced (two loops: 64-key prefix blocks, then 32-key blocks over the step's rows),
on one GPU at the Qwen3-8B attention shape (32 query heads on 8 KV heads of 128, bf16), one layer.

For each case (requests B, rows per request R as an AR step, a 16-token chain or a 32-node tree, context L): both
kernels' time (CUDA events, median of ``--reps`` launches after warm-up, the two interleaved), their largest
difference, and the AR-bits check of the new kernel on the GPU: a chain's rows against one-row passes at their
positions, bit for bit (``chain_rows_equal_ar``; the old kernel's count for contrast).

The old kernel is loaded from git (``--old-rev``, default ``42e40b5``, its ``specpilot/kernels/batch_attention.py``)
or from a copy of that file (``--old-file``, for a machine the checkout reaches without ``.git``) as a separate
module; both share ``kernels/tree_attention.py`` of the checkout.

    SPECPILOT_COMMIT=$(git rev-parse --short HEAD) python probes/batch_attention_aligned_h200.py OUT_DIR

``--smoke``: the CPU through Triton's interpreter, float32, 4 heads on 2 of 32, two small cases (checks that the
script runs and the AR-bits check; its times mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from specpilot.kernels.batch_attention import batch_tree_attention, pack_batch_masks  # noqa: E402
from specpilot.spec.trees import ancestor_mask_of  # noqa: E402

if SMOKE:  # the interpreter's loop-bound fix for numpy >= 2.4 (tests/conftest.py says why)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()

H, KVH, D = (4, 2, 32) if SMOKE else (32, 8, 128)
DEV, DTYPE = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)


def old_kernel(rev: str, src_file: str | None = None):
    """``batch_tree_attention`` of ``rev``'s file (or of ``src_file``, that file saved where the checkout travels
    without its git history), imported under another module name."""
    git = ["git", "show", f"{rev}:specpilot/kernels/batch_attention.py"]
    src = Path(src_file).read_text() if src_file else subprocess.run(git, capture_output=True, text=True,
                                                                     check=True).stdout
    path = Path(tempfile.mkdtemp()) / "batch_attention_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("batch_attention_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.batch_tree_attention


def tree_mask(r: int) -> torch.Tensor:
    """A best-first-like tree of ``r`` rows (root + a spine of 8, the rest hung near the root), fixed seed."""
    g = torch.Generator().manual_seed(0)
    parents = [-1] + list(range(min(8, r - 1)))
    while len(parents) < r:
        parents.append(int(torch.randint(0, min(len(parents), 6), (1,), generator=g)))
    return ancestor_mask_of(parents)


def case(kern, b, r, length, shape, reps):
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(1)
    slots_n, s = b + 1, length + r + 64
    k = torch.randn(slots_n, s, KVH, D, device=dev, generator=g, dtype=DTYPE)
    v = torch.randn(slots_n, s, KVH, D, device=dev, generator=g, dtype=DTYPE)
    q = torch.randn(b * r, H, D, device=dev, generator=g, dtype=DTYPE)
    m = torch.ones(r, r, dtype=torch.bool).tril() if shape != "tree" else tree_mask(r)
    words = pack_batch_masks(m[None].expand(b, r, r).contiguous()).to(dev)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    args = (q, k, v, i32(list(range(b))), i32([length] * b), i32([r] * b), i32([i * r for i in range(b)]), words, r,
            D ** -0.5)
    outs = {name: f(*args) for name, f in kern.items()}
    times = {name: [] for name in kern}
    for _ in range(0 if SMOKE else 10):
        for f in kern.values():
            f(*args)
    for _ in range(reps):
        for name, f in kern.items():
            if SMOKE:
                t0 = time.perf_counter()
                f(*args)
                times[name].append((time.perf_counter() - t0) * 1e6)
                continue
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            f(*args)
            e1.record()
            torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e3)
    row = {"requests": b, "rows": r, "shape": shape, "context": length,
           "us_median": {n: sorted(t)[len(t) // 2] for n, t in times.items()},
           "max_abs_new_vs_old": float((outs["aligned"].float() - outs["old"].float()).abs().max())}
    if shape == "chain":  # AR's bits: each chain row against a one-row pass at its position (request 0)
        one = torch.ones(1, 1, dtype=torch.bool)
        for name, f in kern.items():
            eq = 0
            for i in range(r):
                ar = f(q[i:i + 1], k, v, i32([0]), i32([length + i]), i32([1]), i32([0]),
                       pack_batch_masks(one[None]).to(dev), 1, D ** -0.5)
                eq += bool(torch.equal(outs[name][i], ar[0]))
            row[f"chain_rows_equal_ar_{name}"] = f"{eq}/{r}"
    return row


def main() -> None:
    out = Path(sys.argv[1])
    rev = sys.argv[sys.argv.index("--old-rev") + 1] if "--old-rev" in sys.argv else "42e40b5"
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else (1 if SMOKE else 200)
    out.mkdir(parents=True, exist_ok=True)
    src_file = sys.argv[sys.argv.index("--old-file") + 1] if "--old-file" in sys.argv else None
    kern = {"aligned": batch_tree_attention, "old": old_kernel(rev, src_file)}
    res = {"commit": os.environ.get("SPECPILOT_COMMIT"), "old_rev": rev,
           "device": "cpu (interpreter, smoke)" if SMOKE else torch.cuda.get_device_name(),
           "torch": torch.__version__, "cases": []}
    shapes = [(2, 9, "chain"), (2, 7, "tree")] if SMOKE else [(1, 1, "ar"), (1, 17, "chain"), (1, 33, "tree"),
                                                              (16, 1, "ar"), (16, 17, "chain"), (16, 33, "tree")]
    for b, r, shape in shapes:
        for length in ((60,) if SMOKE else (511, 2047)):
            try:
                res["cases"].append(case(kern, b, r, length, shape, reps))
            except Exception as e:  # a case that fails records its error; the others still run
                res["cases"].append({"requests": b, "rows": r, "shape": shape, "context": length, "error": repr(e)})
            print(json.dumps(res["cases"][-1]), flush=True)
            (out / "aligned_attention.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

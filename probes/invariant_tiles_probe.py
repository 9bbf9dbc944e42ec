"""Which tile shapes keep the batch-invariant GEMM's rows bitwise equal, and how fast each is (bf16, one GPU).

Split-K and BLOCK_K are held at the invariant rule's (the K reduction order); BLOCK_M, BLOCK_N, warps and stages
vary. For each Qwen3-8B projection shape, config and row count: the median time, and whether every row equals the
row from the reference config (BLOCK_M 64, BLOCK_N 64) at 2048 rows, bitwise. Writes ``OUT/invariant_tiles.json``.
Usage: python3 probes/invariant_tiles_probe.py OUT_DIR
"""

import json
import sys

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _launch, invariant_config
from specpilot.provenance import git_commit, versions

sys.path.insert(0, "probes")
from invariant_gemm_probe import SHAPES, ms  # noqa: E402

CONFIGS = {"m16n64w4s5": (16, 64, 4, 5), "m32n64w4s5": (32, 64, 4, 5), "m64n64w4s5": (64, 64, 4, 5),
           "m64n64w4s3": (64, 64, 4, 3), "m64n128w4s4": (64, 128, 4, 4), "m128n64w4s4": (128, 64, 4, 4),
           "m128n128w8s3": (128, 128, 8, 3), "m16n32w4s6": (16, 32, 4, 6)}
ROWS = [1, 32, 224, 2048]


def main(out):
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "versions": versions(), "commit": git_commit(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = (torch.randn(2048, k, device="cuda") * torch.rand(2048, 1, device="cuda") * 4).bfloat16()
        base = invariant_config(n, k)
        ref = _launch(x, w, None, base)
        r = {"split_k": base["split_k"], "cublas_ms": {}, "configs": {}}
        for m in ROWS:
            r["cublas_ms"][m] = ms(lambda: F.linear(x[:m], w), reps=20)
        for cname, (bm, bn, warps, stages) in CONFIGS.items():
            cfg = dict(base, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            r["configs"][cname] = {}
            for m in ROWS:
                xm = x[:m].contiguous()
                try:
                    same = torch.equal(_launch(xm, w, None, cfg), ref[:m])
                    t = ms(lambda: _launch(xm, w, None, cfg), reps=20)
                except Exception as e:  # noqa: BLE001 (out of shared memory: recorded)
                    same, t = None, str(e).splitlines()[0][:80]
                r["configs"][cname][m] = {"ms": t, "rows_equal": same}
            print(name, cname, r["configs"][cname], flush=True)
        print(name, "cublas", r["cublas_ms"], flush=True)
        res["shapes"][name] = r
        del w, x, ref
    with open(f"{out}/invariant_tiles.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

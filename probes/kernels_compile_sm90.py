"""Every distinct Triton launch the kernel tests make in the interpreter, compiled for sm_90a on the CPU (no GPU;
Triton's bundled ptxas): each launch's kernel, file, the first test that made it, specialization (argument types,
16-divisibility, constexprs, launch options), how many recorded launches share it, ok / the compiler's message, and
its compile seconds (a fresh Triton cache: every launch really compiles). tests/kernel_launches.py does the work;
tests/test_kernels_compile_sm90.py is the CI check over its ``CI`` selection, this probe runs ``ALL`` (every kernel
test, the slow and the model- and engine-level ones too; ``--ci``: the CI selection).

Run (CPU): ``python probes/kernels_compile_sm90.py OUT.json [--ci] [--workers N]``. Exit status 1 when a launch
fails to compile.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specpilot.kernels.launches import failure_line  # noqa: E402
from specpilot.provenance import git_commit, versions  # noqa: E402
from tests import kernel_launches  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ci", action="store_true", help="the CI selection only (what the test compiles)")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    sel = kernel_launches.CI if a.ci else kernel_launches.ALL
    run = kernel_launches.check(sel, workers=a.workers, fresh_cache=True)
    res = run["results"]
    failed = [r for r in res if not r["ok"]]
    by_kernel: dict[str, int] = {}
    for r in res:
        by_kernel[r["kernel"]] = by_kernel.get(r["kernel"], 0) + 1
    out = {"device": "cpu (offline sm_90a compile)", "target": "GPUTarget('cuda', 90, 32)",
           "cpu": platform.processor() or platform.machine(), "commit": git_commit(), "versions": versions(),
           "selection": "ci" if a.ci else "all", "tests": sel["tests"], "deselected": sel["deselect"],
           "pytest": run["pytest"], "workers": a.workers, "record_s": round(run["record_s"], 1),
           "compile_s": round(run["compile_s"], 1), "recorded_launches": run["launches"],
           "distinct_launches": len(res), "failed": len(failed),
           "compile_s_sum": round(sum(r["seconds"] for r in res), 1), "distinct_by_kernel": by_kernel,
           "recorded_not_run": sum(not r.get("ran", True) for r in res),  # bfloat16 ones (tests/launches_bf16.py)
           "launches": [{k: r.get(k, True if k == "ran" else None) for k in (
               "kernel", "file", "line", "test", "ran", "specialization", "launches", "ok", "error", "seconds")}
               for r in res]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"{len(res)} distinct launches ({run['launches']} recorded), {len(failed)} failed; record "
          f"{run['record_s']:.0f} s, compile {run['compile_s']:.0f} s")
    for r in failed:
        print(failure_line(r))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton launches of the kernel tests, compiled for sm_90a on the CPU (specpilot.kernels.launches).

The CPU suite runs every kernel in Triton's interpreter, which accepts code the compiler refuses. :func:`check` runs a
selection of kernel tests under the interpreter in one subprocess, recording every launch (this module is the pytest
plugin that does it: ``-p tests.kernel_launches`` with ``SPECPILOT_RECORD_LAUNCHES=OUT.json``), then compiles each
distinct launch for sm_90a in a second subprocess without the interpreter (``python -m tests.kernel_launches compile
IN.json OUT.json``). Two processes because the interpreter patches ``triton.language`` for its whole process.

:data:`CI` is what tests/test_kernels_compile_sm90.py compiles within its time budget (every kernel module's tests
but the slowest, and of their launches a subset that compiles each argument value once); :data:`ALL` is every launch
of every kernel test, what probes/kernels_compile_sm90.py compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the kernel modules' own tests: each kernel of specpilot/kernels, specpilot/w12, specpilot/head and the bench's
#: read-floor kernel, at the shapes and launch options (tile sizes, warps, stages, split K) those tests use; and
#: launches_bf16.py, their bfloat16 cases (the GPU's dtype, which the interpreter cannot run) recorded, not run
KERNEL_TESTS = ["tests/test_tree_attention.py", "tests/test_batch_attention.py", "tests/test_gdn_kernels.py",
                "tests/test_gdn_wy.py", "tests/test_hybrid_glue.py", "tests/test_fused.py", "tests/test_gemm.py",
                "tests/test_w12_gemm.py", "tests/test_w12_view_gemm.py", "tests/test_w12_swiglu.py",
                "tests/test_w12_norm.py", "tests/test_w12_dense.py", "tests/test_int8_head_kernel.py",
                "tests/test_read_floor.py", "tests/launches_bf16.py"]

#: tests that run a whole model or engine through the kernels (tiny shapes: launches the kernel tests already make,
#: at other sizes) and cost most of the recording time; CI leaves them out, the probe keeps them
SLOW = ["engine", "model_pass", "static_pass", "tiny_gdn", "takes_what_the_model", "models_batched",
        "batched_engine", "a_requests_rows", "speculative_output", "wide_w12_pass"]

#: the kernel tests that take longest in the interpreter (2.5 to 40 s a name, 215 s of the 270 s that all the
#: kernel tests take on a shared 2-core CPU), left out of CI: the rest still make launches with each argument value
#: (type, alignment, constexpr) and launch option that all of them make but 14 of 785 (a recording's launches
#: grouped by their ``test``; the 14: a few head-kernel tiles, batch-attention integer specializations, W12 split-K
#: 4 / 5 and 3 load stages); the probe compiles everything
SLOW_CI = ["test_w12_gemm_matches_reference_within_rounding", "test_argmax_random", "test_real_arithmetic_ties",
           "test_one_ulp_nudges", "test_fused_split_k_equals_the_split_sum_kernel_bitwise",
           "test_residual_add_is_bitwise_residual_plus_the_gemv", "test_fused_swiglu_is_bitwise_silu_mul_then_the_gemv",
           "test_chain_and_prompt_rows_carry_ar_bits", "test_gemv_pipelined_k_loop_is_bitwise_the_plain_loop",
           "test_view_gemm_matches_reference_is_deterministic", "test_fused_norm_equals_the_gemv_of_the_normalised_row",
           "test_cli_refuses_in_one_line_without_cuda", "(test_tree_attention and test_kernel_matches_reference)",
           "test_path_kernel_matches_reference_and_leaves_the_state", "test_one_root_paths_table_serves_every_layer",
           "test_combine_launch_does_not_spill_on_sm90"]

#: CI: the kernel tests but the slow ones; of their distinct launches, :func:`~specpilot.kernels.launches.
#: covering_subset`'s (each argument value and launch option compiled once, not each combination of them)
CI = {"tests": KERNEL_TESTS, "deselect": SLOW + SLOW_CI, "cover": True}
ALL = {"tests": KERNEL_TESTS, "deselect": []}

_ENV_OUT = "SPECPILOT_RECORD_LAUNCHES"
_records: list = []
_recorder = None


def pytest_configure(config):
    """Start recording when ``SPECPILOT_RECORD_LAUNCHES`` names an output file (plugin hook)."""
    global _recorder
    if os.environ.get(_ENV_OUT):
        from specpilot.kernels.launches import record_launches

        _recorder = record_launches(_records)
        _recorder.__enter__()


def pytest_unconfigure(config):
    """Stop recording and write the launches as JSON (plugin hook)."""
    global _recorder
    if _recorder is not None:
        _recorder.__exit__(None, None, None)
        _recorder = None
        Path(os.environ[_ENV_OUT]).write_text(json.dumps(_records))


def _env(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def record(selection: dict, out: Path, timeout: float = 1800) -> dict:
    """Run ``selection["tests"]`` (pytest paths or node ids) under the interpreter in a subprocess, leaving out tests
    whose names contain a ``selection["deselect"]`` string, and write their launches to ``out``.

    Returns ``{"launches": [...], "seconds": wall time, "pytest": pytest's last output line}``.
    Raises RuntimeError when pytest fails (a failing kernel test would record a partial set) or writes nothing."""
    out = Path(out)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.kernel_launches", "-x",
           *selection["tests"]]
    if selection.get("deselect"):
        cmd += ["-k", " and ".join(f"not {s}" for s in selection["deselect"])]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(True) | {_ENV_OUT: str(out)}, capture_output=True, text=True,
                          timeout=timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"recording run failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    return {"launches": json.loads(out.read_text()), "seconds": time.perf_counter() - t, "pytest": tail[0]}


def compile_recorded(launches: Path, out: Path, workers: int = 1, cache_dir: str | None = None, cover: bool = False,
                     timeout: float = 3600) -> list[dict]:
    """Compile the launches in the JSON file ``launches`` for sm_90a in a subprocess without the interpreter
    (``workers`` compiling processes; ``cache_dir``: Triton's cache directory, default its own; ``cover``: only a
    covering subset), write the results to ``out`` and return them
    (:func:`specpilot.kernels.launches.compile_launches`). Raises RuntimeError when the subprocess fails."""
    env = _env(False) | ({"TRITON_CACHE_DIR": cache_dir} if cache_dir else {})
    proc = subprocess.run([sys.executable, "-m", "tests.kernel_launches", "compile", str(launches), str(out),
                           str(workers), "cover" if cover else "all"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(out).is_file():
        raise RuntimeError(f"compile run failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(Path(out).read_text())


def check(selection: dict, workers: int = 1, fresh_cache: bool = True) -> dict:
    """Record ``selection``'s launches (:func:`record`) and compile each distinct one (:func:`compile_recorded`; only
    a covering subset where ``selection["cover"]``), in a fresh Triton cache unless ``fresh_cache`` is False (then
    kernels compiled earlier and cached count as compiled).

    Returns ``{"results": one dict per distinct launch, "launches": recorded launches, "record_s", "compile_s",
    "pytest"}``. Raises RuntimeError when either subprocess fails."""
    with tempfile.TemporaryDirectory(prefix="kernel_launches_") as d:
        rec = record(selection, Path(d) / "launches.json")
        t = time.perf_counter()
        res = compile_recorded(Path(d) / "launches.json", Path(d) / "results.json", workers,
                               cache_dir=str(Path(d) / "cache") if fresh_cache else None,
                               cover=bool(selection.get("cover")))
        return {"results": res, "launches": len(rec["launches"]), "record_s": rec["seconds"],
                "compile_s": time.perf_counter() - t, "pytest": rec["pytest"]}


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "compile" or sys.argv[5] not in ("all", "cover"):
        sys.exit("usage: python -m tests.kernel_launches compile LAUNCHES.json OUT.json WORKERS all|cover")
    from specpilot.kernels.launches import compile_launches

    results = compile_launches(json.loads(Path(sys.argv[2]).read_text()), workers=int(sys.argv[4]),
                               cover=sys.argv[5] == "cover")
    Path(sys.argv[3]).write_text(json.dumps(results, indent=1))

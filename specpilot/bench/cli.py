"""``specpilot bench``: check the options, run one suite, print its summary. The main app registers
:func:`bench` as a command (``specpilot.cli``); errors are :class:`~specpilot.errors.SpecPilotError` (one line,
exit status 2).

Suites: ``systems`` (default, :mod:`.engine`: our AR and speculative systems vs transformers' ``generate`` on one
checkpoint, c(N), the byte floor), ``w12`` (:mod:`.w12`), ``lm-head`` (:mod:`.lm_head`), ``read-floor``
(:mod:`.read_floor`), ``drafter-step`` (:mod:`.drafter_step`) and ``tlv`` (:mod:`.tlv`). The last five build random
Qwen3-8B / 32B-shaped weights themselves and write
``<out>/<suite>_bench_<device type>_<date>.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from specpilot.errors import SpecPilotError, validation_message
from specpilot.fileio import output_dir

SUITES = ("systems", "w12", "lm-head", "read-floor", "drafter-step", "tlv")
#: suites that need a CUDA GPU on every device (lm-head has a CPU smoke run in the Triton interpreter)
CUDA_ONLY = ("w12", "read-floor", "drafter-step", "tlv")


def bench(
    target: Optional[Path] = typer.Option(None, help="Checkpoint directory (e.g. from `specpilot zoo random`); "
                                          "required by the systems suite (and --dtype, --prefix, --new-tokens, "
                                          "--transformers apply to it alone)."),
    suite: str = typer.Option("systems", help="systems (our AR and speculative systems vs transformers) | w12 (W12 "
                              "GEMM vs cuBLAS on Qwen3-8B/32B projections, AR with and without W12; CUDA) | lm-head "
                              "(certified INT8 head vs bf16 head; CUDA, or a tiny interpreter smoke run on the CPU) | "
                              "read-floor (a plain streaming read of each projection's bytes beside cuBLAS and W12: "
                              "the measured byte floor; CUDA) | drafter-step (a block drafter's step, graphed and eager, beside an AR "
                              "step; CUDA) | tlv (a TLV cycle's time split beside the single-pass system; CUDA)."),
    device: str = typer.Option("cuda", help="torch device."),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16 | float16"),
    prefix: int = typer.Option(512, help="Prompt length in tokens."),
    new_tokens: int = typer.Option(128, help="Tokens generated per system."),
    out: Path = typer.Option(Path("results"), help="Directory for the JSON result (and the systems suite's PNG)."),
    transformers_generate: bool = typer.Option(True, "--transformers/--no-transformers",
                                               help="Also time transformers' generate."),
    batch: Optional[str] = typer.Option(None, help="Batch sizes, e.g. 1,2,4,8,16,32: the batched engine under load "
                                        "(open and closed loop), AR beside the speculative system of --drafter, "
                                        "--tree, --nodes, --depth, --top-k; needs --target."),
    drafter: str = typer.Option("ngram", help="With --batch: ngram | draft_model | block | calibrated (--drafter-path "
                                "a calibration file from `specpilot calibrate`: acceptance SIMULATED)."),
    drafter_path: Optional[Path] = typer.Option(None, help="With --batch: the draft model or block drafter dir."),
    tree: str = typer.Option("best_first", help="With --batch: the speculative system's tree builder."),
    nodes: int = typer.Option(6, help="With --batch: tree budget N."),
    depth: int = typer.Option(4, help="With --batch: draft positions."),
    top_k: int = typer.Option(2, help="With --batch: candidates a position."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: the pilot's rule: 1 on a CPU device "
                                          "with <= 2 cores, else torch's default)."),
    system: Optional[Path] = typer.Option(None, help="With --batch: a `specpilot pilot --batch` output directory (or "
                                          "a system.json): its sealed systems, each step running the one sealed "
                                          "nearest its load, beside AR and stock at every size, paired rounds over "
                                          "the bundled benchmarks with 95% lower bounds (--new-tokens per request; "
                                          "the systems' dtype; --target replaces their recorded target)."),
    rounds: int = typer.Option(3, help="With --batch --system: A B B A rounds per benchmark and size (at least 2)."),
    per_benchmark: int = typer.Option(2, help="With --batch --system: prompts of each bundled benchmark."),
    compile_cpu: bool = typer.Option(False, "--compile", help="With --batch --system on the CPU: AR, stock and the "
                                     "plan all run the compiled batched pass (`serve --compile`'s)."),
):
    """Benchmarks: our AR and speculative systems beside transformers' generate, c(N) and the byte floor (the
    default systems suite); --suite w12, lm-head, read-floor, drafter-step or tlv for the W12, certified-head,
    read-floor, learned-drafter-step and TLV-cycle suites."""
    from specpilot.engine.deployment import check_device
    from specpilot.model.checkpoint import DTYPES, read_args

    if system is not None:
        return _sealed(system, target, batch, device, new_tokens, out, threads, rounds, per_benchmark, compile_cpu)
    if batch is not None:
        return _batch(target, batch, device, dtype, prefix, new_tokens, out, drafter, drafter_path, tree, nodes, depth,
                      top_k, threads)
    if suite not in SUITES:
        raise SpecPilotError(f"--suite: unknown suite {suite!r} (choose {', '.join(SUITES[:-1])} or {SUITES[-1]})")
    if suite != "systems":
        if target is not None:
            raise SpecPilotError(f"--target applies to the systems suite only (--suite {suite} uses random "
                                 "Qwen3-8B / 32B-shaped weights)")
        use_threads(check_device(device), threads)
        raise typer.Exit(run_suite(suite, check_device(device), out))
    if target is None:
        raise SpecPilotError("--target is required by the systems suite (a checkpoint directory, e.g. from "
                             "`specpilot zoo random`)")
    if dtype not in DTYPES:
        raise SpecPilotError(f"unknown --dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if prefix < 1 or new_tokens < 1:
        raise SpecPilotError(f"--prefix and --new-tokens must be at least 1, got {prefix} and {new_tokens}")
    args = read_args(target)  # a bad checkpoint directory is named before the device is checked
    context = min(args.max_position_embeddings, 4096)  # the engine's context (Engine.max_len)
    if prefix + max(new_tokens, 256) > context:  # c(N) is measured up to 256 rows after the prefix
        raise SpecPilotError(f"--prefix {prefix} + max(--new-tokens {new_tokens}, 256 rows) exceeds the target's "
                             f"context of {context} tokens")
    check_float16_device(dtype, check_device(device))
    n_threads = use_threads(check_device(device), threads)
    output_dir(out, "--out")
    from specpilot.bench.engine import run_bench

    res = run_bench(target, check_device(device), dtype, prefix, new_tokens, out, with_transformers=transformers_generate)
    print(json.dumps({"device": res["device"], "threads": n_threads} | {k: res[k] for k in ("ar_ms_per_step", "ar_tokens_per_s", "byte_floor_ms", "percent_of_floor")}
                     | {"c_33": res["c"].get(33), "c_64": res["c"].get(64)}
                     | ({"step_over_kernels": res["ar_step_profile"]["wall_over_kernels"]} if "ar_step_profile" in res else {})
                     | ({"ar_equals_transformers": res["ar_equals_transformers"]} if "ar_equals_transformers" in res else {}),
                     indent=1))


def _batch(target, batch, device, dtype, prefix, new_tokens, out, drafter, drafter_path, tree, nodes, depth, top_k,
           threads) -> None:
    """``specpilot bench --batch``: check the options, run :func:`specpilot.bench.batch.run_batch_bench`, print a
    table."""
    from specpilot.config import SystemConfig
    from specpilot.engine.deployment import check_device
    from specpilot.model.checkpoint import read_args

    if target is None:
        raise SpecPilotError("--batch needs --target (a checkpoint directory, e.g. from `specpilot zoo random`)")
    sizes = _sizes(batch)
    if prefix < 1 or new_tokens < 1:
        raise SpecPilotError(f"--prefix and --new-tokens must be at least 1, got {prefix} and {new_tokens}")
    args = read_args(target)
    if prefix + new_tokens + 8 > min(args.max_position_embeddings, 4096):
        raise SpecPilotError(f"--prefix {prefix} + --new-tokens {new_tokens} exceeds the target's context")
    calibration = None
    if drafter == "calibrated":  # the file is the system's drafter_path, not a drafter checkpoint of the deployment
        if drafter_path is None:
            raise SpecPilotError("--drafter calibrated needs --drafter-path, a calibration file (specpilot calibrate)")
        from specpilot.spec.calibration import load_calibration

        load_calibration(drafter_path)  # a bad file: its one-line CalibrationError now
        calibration, drafter_path = str(drafter_path), None
    try:
        spec = SystemConfig(drafter=drafter, drafter_path=calibration, tree=tree, nodes=nodes, depth=depth, top_k=top_k)
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {validation_message(e)}") from None
    dev = check_device(device)
    check_float16_device(dtype, dev)
    use_threads(dev, threads)
    output_dir(out, "--out")
    from specpilot.bench.batch import run_batch_bench

    res = run_batch_bench(target, sizes, spec, dev, dtype, prefix, new_tokens, out, drafter=drafter_path)
    for name, label in res["systems"].items():
        for b in sizes:
            r = res["runs"][f"{name}@{b}"]
            x = res["speedup_vs_single_engine_ar"][f"{name}@{b}"]
            print(f"{label:32s} batch {b:3d}: {r['open']['aggregate_tokens_per_s']:8.1f} tok/s "
                  f"({x['aggregate']:5.2f}x single-request AR), decode {r['open']['decode_tokens_per_s'] or 0:8.1f} "
                  f"tok/s ({x['decode']:5.2f}x), closed loop {r['closed']['aggregate_tokens_per_s']:8.1f} tok/s, "
                  f"outputs equal batch 1: {r['outputs_equal_batch1']:.2f} "
                  f"(the single-request engine's: {r['outputs_equal_single_engine']:.2f})")
    print(f"single-request engine AR: {res['single_engine']['ar']['tokens_per_s_median']:.1f} tok/s")
    if res.get("simulated"):
        print(res["simulated"])
    for key in (k for k in res if k.startswith("forcing_") and isinstance(res[k], dict) and "passed" in res[k]):
        f = res[key]
        print(f"{key}: {'passed' if f['passed'] else 'FAILED'} ({f['mismatches']} mismatches, {f['events']} events "
              f"in {f['tokens']} tokens, δ {f['delta']:g}){'; ' + '; '.join(f['reasons']) if f['reasons'] else ''}")
    print(f"wrote {res['path']}")


def _sealed(system, target, batch, device, new_tokens, out, threads, rounds, per_benchmark, compile_cpu=False) -> None:
    """``specpilot bench --batch SIZES --system PILOT_DIR``: :func:`specpilot.bench.batch_sealed.run_sealed_bench`."""
    from specpilot.engine.deployment import check_device
    from specpilot.engine.load_plan import LoadPlan
    from specpilot.serve.system_file import load_sealed

    if batch is None:
        raise SpecPilotError("--system needs --batch SIZES (the sizes to measure the sealed systems at)")
    sizes = _sizes(batch)
    if rounds < 2 or per_benchmark < 1 or new_tokens < 1:
        raise SpecPilotError(f"--rounds must be at least 2 and --per-benchmark, --new-tokens at least 1, got {rounds}, "
                             f"{per_benchmark}, {new_tokens}")
    sealed = load_sealed(system, target, False, None, device)
    plan = sealed.config if isinstance(sealed.config, LoadPlan) else LoadPlan.single(sealed.config)
    dev = check_device(device)
    if compile_cpu and dev.split(":")[0] != "cpu":
        raise SpecPilotError(f"--compile runs the compiled batched CPU pass: not on {device}")
    check_float16_device(plan.configs[0].dtype, dev)
    use_threads(dev, threads)
    output_dir(out, "--out")
    from specpilot.bench.batch_sealed import run_sealed_bench

    res = run_sealed_bench(plan, sealed.tdir, sealed.ddir, sizes, dev, out, rounds, per_benchmark, new_tokens,
                           compile_cpu=compile_cpu)
    print(f"every size's lower bound >= {res['bar']} against AR and stock: {res['meets_bar_at_every_size']}")
    print(f"wrote {res['path']}")


def _sizes(batch: str) -> list[int]:
    """``--batch``'s sizes. Raises SpecPilotError: not comma-separated integers, or one below 1."""
    try:
        sizes = [int(x) for x in batch.split(",") if x.strip()]
    except ValueError:
        raise SpecPilotError(f"--batch takes comma-separated request counts, e.g. 1,2,4,8, got {batch!r}") from None
    if not sizes or min(sizes) < 1:
        raise SpecPilotError(f"--batch sizes must be at least 1, got {batch!r}")
    return sizes


def use_threads(device: str, threads: Optional[int]) -> int:
    """Set torch's CPU threads for a bench run as the pilot and ``generate`` pick them
    (:func:`specpilot.pilot.setup.choose_threads`: ``--threads``, else 1 on a CPU device with <= 2 cores, where
    2 threads made an AR step several times slower on a loaded machine, else torch's default); returns the count.

    Raises:
        SpecPilotError: ``threads < 1``.
    """
    import torch

    from specpilot.pilot.setup import available_cores, choose_threads

    try:
        n, _ = choose_threads(device, threads, available_cores(), torch.get_num_threads())
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {e}") from None
    torch.set_num_threads(n)
    return n


def check_float16_device(dtype: str, device: str) -> None:
    """Refuse float16 on the CPU: torch's CPU float16 kernels are slow and the pilot's (and the bench's) timings,
    margins and byte floor with them mean nothing for a deployment (a float16 CPU matmul peak of ~1 GFLOP/s put
    a bench at 500% of its "floor").

    Raises:
        SpecPilotError: ``dtype == "float16"`` and ``device`` (a valid torch device string) is a CPU.
    """
    import torch

    if dtype == "float16" and torch.device(device).type == "cpu":
        raise SpecPilotError("--dtype float16 is not supported on the CPU (slow, and not a deployment dtype there): "
                             "use --dtype float32 or bfloat16, or --device cuda")


def run_suite(suite: str, device: str, out: Path) -> int:
    """Run ``suite`` (one of :data:`SUITES` but ``systems``) on ``device`` into
    ``out/<suite>_bench_<device type>_<date>.json``. Returns the exit status (lm-head: 1 when a correctness check
    failed). Raises SpecPilotError for a CUDA-only suite off CUDA, a CPU lm-head run without Triton installed, or
    after Triton was imported without its interpreter."""
    import torch

    from specpilot.bench.engine import result_stem

    cuda = torch.device(device).type == "cuda"
    if suite in CUDA_ONLY and not cuda:
        raise SpecPilotError(f"--suite {suite} needs a CUDA GPU (--device cuda)")
    if not cuda and importlib.util.find_spec("triton") is None:
        raise SpecPilotError("the CPU run of --suite lm-head runs the Triton kernels in Triton's interpreter: install "
                             "triton (pip install 'triton==3.6.0', or the package's [test] extra)")
    outp = output_dir(out, "--out")
    outp.mkdir(parents=True, exist_ok=True)
    path = outp / (result_stem(outp, "", device, label=suite.replace("-", "_") + "_bench") + ".json")
    if suite in CUDA_ONLY:
        if suite == "w12":
            from specpilot.bench.w12 import main as run
        elif suite == "drafter-step":
            from specpilot.bench.drafter_step import run
        elif suite == "tlv":
            from specpilot.bench.tlv import run
        else:
            from specpilot.bench.read_floor import main as run
        with torch.cuda.device(torch.device(device)):
            run(str(path))
        print(f"wrote {path}")
        return 0
    if not cuda:  # the interpreter must be chosen before Triton is first imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SpecPilotError("the CPU run of --suite lm-head needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    from specpilot.bench.lm_head import main as lm_main

    if cuda:
        with torch.cuda.device(torch.device(device)):
            return lm_main(["--out", str(path), "--bundled"])
    return lm_main(["--out", str(path), "--quick", "--no-sweep"])

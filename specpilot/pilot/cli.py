"""``specpilot pilot``: the procedure (§3) on one deployment, or per batch size with ``--batch`` (§4.4, §5.1).

Registered by :mod:`specpilot.cli` (thin: parse, check, call :func:`specpilot.pilot.run.run_pilot` or
:func:`specpilot.pilot.batch_pilot.run_batch_pilot`); user errors are :class:`~specpilot.errors.SpecPilotError` (one
line, exit status 2). :func:`check_report_dir` guards a user's own files in ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from specpilot.bench.cli import check_float16_device
from specpilot.errors import SpecPilotError
from specpilot.fileio import output_dir

#: files a pilot run writes into its --out (rewritten by the next run into the same directory)
PILOT_FILES = ("report.json", "report.md", "system.json", "speedup.png", "tau_vs_n.png", "c_vs_n.png", "ceiling.png",
               "outputs/stock_phase0.jsonl", "outputs/sealed.jsonl", "batch_report.json", "batch_report.md")


def check_report_dir(out: Path, batched: bool = False) -> None:
    """Raise :class:`SpecPilotError` when ``out`` already holds a file a pilot writes (:data:`PILOT_FILES`) but no
    earlier pilot's ``report.json`` or run marker: the run would overwrite a user's own file (``--out .`` in a project);
    or when it holds the other kind of pilot run (``batched``: this one is ``--batch``), whose ``system.json`` this run
    would replace under its report. An earlier report of the same kind is rewritten, as documented; files of other
    names are never touched."""
    from specpilot.pilot.phase0 import RUN_MARKER

    other = ("report.json",) if batched else ("batch_report.json", "journal.json")
    if any((out / n).exists() for n in other):
        kind = "single-request" if batched else "batched (--batch)"
        raise SpecPilotError(f"--out {out} holds a {kind} pilot run, whose system.json this run would replace: "
                             "choose another directory")

    clash = [n for n in PILOT_FILES if (out / n).exists()] + sorted(p.name for p in out.glob("system_n*.json"))
    if not clash or (out / RUN_MARKER).is_file():  # a pilot wrote them, maybe in a run that failed before its report
        return
    try:
        ours = {"deployment", "phase0"} <= set(json.loads((out / "report.json").read_text()))
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise SpecPilotError(f"--out {out} already holds {', '.join(clash[:3])}, which a pilot run would overwrite, and "
                             "no earlier pilot report: choose a new or empty directory")


def check_learned_dir(flag: str, path: Path, want: str) -> None:
    """Check that ``path``, given to ``flag`` (``--block`` or ``--eagle3``), is a drafter directory of kind ``want``
    (``block`` takes the Markov variant too). Raises SpecPilotError: one line naming the flag, and the flag its kind
    goes to; a directory without a readable config.json is left to the loader, which names the missing file."""
    from specpilot.cli import drafter_kind

    if not path.is_dir():
        raise SpecPilotError(f"{flag} {path}: " + ("a file, not a drafter directory" if path.exists() else "no such directory"))
    kind = drafter_kind(path)
    if kind is None or kind == want or (want == "block" and kind.startswith("block")):
        return
    use = {"eagle3": "--eagle3", "draft_model": "--drafter-path"}.get(kind, "--block")
    raise SpecPilotError(f"{flag} {path} holds a drafter of kind {kind} (from its config.json), not {want}: give it "
                         f"with {use}")


def pilot_cmd(
    quick: bool = typer.Option(False, help="Smoke run: its plan is sized from measured step times to fit about 3 minutes (the expected duration is printed before it starts)."),
    per_benchmark: Optional[int] = typer.Option(None, min=2, help="Requests per benchmark, at least 2 (the paired bootstrap needs two requests of a benchmark; default 4; --quick 2)."),
    max_new_tokens: Optional[int] = typer.Option(None, min=1, help="New tokens per request (default 64; --quick at most 32)."),
    rounds: Optional[int] = typer.Option(None, min=0, help="Planner rounds after round 0 (default 3; --quick 1)."),
    adversarial: bool = typer.Option(False, help="Also judge A vs A and the cheating candidates (cached outputs, "
                                     "lazy outputs, a thread left running, a logit bias, FP8 verification, skipped "
                                     "verification) in this run; each must be rejected (report section)."),
    out: Path = typer.Option(Path("specpilot-report"), help="Report directory (with --batch: one sealed system per "
                             "size, the directory `serve --system` and `bench --batch --system` take)."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: bundled)."),
    drafter_path: Optional[Path] = typer.Option(None, help="Draft model directory (default: bundled drafter with the bundled target)."),
    device: Optional[str] = typer.Option(None, help="torch device of the pilot's own process (profiling, scorer). Default: the first of --devices, else cpu."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    seed: int = typer.Option(0, help="Seed for request sampling and bootstrap."),
    block: Optional[List[Path]] = typer.Option(None, help="Block drafter directory the planner may propose (repeatable; default with the bundled target and no --batch: the bundled block and block_markov drafters; with --batch: one drafter-swap candidate each)."),
    eagle3: Optional[List[Path]] = typer.Option(None, help="EAGLE-3 drafter directory the planner may propose (ours from `train-drafter --kind eagle3`, or a public head; repeatable; with --batch: one drafter-swap candidate each)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: 1 on a CPU device with <= 2 cores, else torch's default)."),
    memory: Optional[Path] = typer.Option(None, help="Memory directory of an earlier run: start from stock + its entries, re-tuned and re-measured here (§3.5)."),
    devices: Optional[str] = typer.Option(None, help="Comma-separated devices judging candidates at once, one worker process per system (e.g. cuda:0,cuda:1; cpu,cpu on the CPU). Default: just --device."),
    paired_devices: Optional[bool] = typer.Option(None, "--paired-devices/--no-paired-devices", help="Judge on device pairs (A on one, B on the other, swapped). Default: on iff exactly two devices."),
    executor: str = typer.Option("auto", help="auto | local (in-process, one device) | workers (one process per system). auto: workers with several devices or --agent."),
    agent: Optional[str] = typer.Option(None, help="External coding agent, a shell command template with {brief} and {worktree}; called once per round after the config candidates."),
    agent_timeout: float = typer.Option(1800.0, help="Seconds the agent may run per round."),
    scorer_dtype: Optional[str] = typer.Option(None, help="Token forcing's scorer body dtype: default the deployment's (the paper: stock's target with an FP32 LM head); float32 loads a float32 copy of the target (compares every system to unrounded arithmetic; needs the memory)."),
    calibration: Optional[Path] = typer.Option(None, help="Calibration file of a real pair (docs/calibrated-drafter.md): the planner may also propose the 'calibrated' drafter, whose acceptance is SIMULATED (for random-weight targets of real shapes); not with --agent."),
    batch: Optional[str] = typer.Option(None, help="Batch sizes, e.g. 1,4,16: the batched pilot (docs/batch-pilot.md) judges systems by batch runs at these sizes instead (--rounds: its A B B A rounds, default 3, --quick 2)."),
    prompts: Optional[Path] = typer.Option(None, help="The deployment's own requests instead of the bundled benchmarks: JSON Lines, one OpenAI request body per line (chat or completion, as sent to `specpilot serve`), an optional \"group\" per line as the stratum (docs/batch-pilot.md); --per-benchmark caps the requests per group, --max-new-tokens each body's max_tokens."),
    aligned: bool = typer.Option(False, help="CUDA only, not with --batch. Every system's single-request passes run the batched engine's kernels (batch-invariant GEMMs, AR-aligned attention): a tree's top chain then gets the one-row AR pass's bf16 bits, so a calibrated drafter's recorded continuation holds in tree passes (docs/tlv.md). Slower than cuBLAS and split-KV."),
    compile_cpu: bool = typer.Option(False, "--compile", help="With --batch on the CPU: every system is measured on the compiled batched pass that `serve --compile` runs (compiled once at start, about 30-40 s for SmolLM2 on 2 cores)."),
):
    """Run the SpecPilot procedure (§3): Phase 0, cost model, planner, controller, token forcing, seal."""
    from specpilot.model.checkpoint import DTYPES
    from specpilot.engine.deployment import check_device
    from specpilot.cli import check_drafter_kind
    from specpilot.pilot.run import PilotOptions, run_pilot

    if dtype not in DTYPES:
        raise SpecPilotError(f"unknown --dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if scorer_dtype is not None and scorer_dtype not in ("float32", dtype):
        raise SpecPilotError(f"--scorer-dtype {scorer_dtype!r}: the scorer runs in float32 or in the deployment's "
                             f"--dtype ({dtype}, the default: leave the flag out)")
    tdir, ddir = target, drafter_path
    if ddir is not None:  # stock's draft model: a block drafter goes to --block (planner candidates)
        check_drafter_kind("draft_model", ddir)
    for flag, dirs, want in (("--block", block, "block"), ("--eagle3", eagle3, "eagle3")):
        for d in dirs or ():
            check_learned_dir(flag, d, want)
    if tdir is None:
        from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir, bundled_drafter_dir, bundled_target_dir

        tdir, ddir = bundled_target_dir(), ddir or bundled_drafter_dir()
        if block is None and batch is None:  # the batched pilot judges the checkpoints named, one swap each
            block = [bundled_block_dir(), bundled_block_markov_dir()]
    if max_new_tokens is not None:  # hopeless before any measurement (the run itself drops single long prompts)
        from specpilot.model.checkpoint import read_args
        from specpilot.pilot.controller import SALT_TOKENS

        context = min(read_args(tdir).max_position_embeddings, 4096)  # the engine's max_len
        if max_new_tokens + SALT_TOKENS + 1 > context:
            raise SpecPilotError(f"--max-new-tokens {max_new_tokens}: no prompt fits the target's context of {context} "
                                 f"tokens with that many new tokens (and the controller's {SALT_TOKENS}-token salt)")
    if batch is not None:  # the batched pilot, the same options; bad sizes fail first (the --out checks read them)
        from functools import partial

        from specpilot.pilot.batch_pilot import parse_sizes, run_batch_pilot

        run_pilot = partial(run_batch_pilot, sizes=parse_sizes(batch))
    output_dir(out, "--out")
    check_report_dir(out, batched=batch is not None)
    devs = tuple(d.strip() for d in devices.split(",")) if devices is not None else ()
    if any(not d for d in devs):
        raise SpecPilotError(f"--devices {devices!r}: give comma-separated devices, e.g. cuda:0,cuda:1")
    for d in devs:
        check_device(d)
    device = device or (devs[0] if devs else "cpu")
    if compile_cpu and (batch is None or device.split(":")[0] != "cpu"):
        raise SpecPilotError("--compile measures the batched CPU pass that `serve --compile` runs: it needs --batch "
                             f"and a CPU device (got {'no --batch' if batch is None else device})")
    if aligned and batch is not None:
        raise SpecPilotError("--aligned puts single-request passes on the batched engine's kernels; --batch runs "
                             "the batched engine, whose passes have them already: drop one of the two")
    if aligned and device.split(":")[0] != "cuda":
        raise SpecPilotError(f"--aligned picks CUDA kernels (Triton); on {device} the single-request pass has no "
                             "fused path to align: leave the flag out")
    check_float16_device(dtype, check_device(device))
    if agent is not None and ("{worktree}" not in agent or not agent.strip()):
        raise SpecPilotError("--agent must be a command template containing {worktree} (and usually {brief})")
    if agent_timeout <= 0:
        raise SpecPilotError(f"--agent-timeout must be positive, got {agent_timeout}")
    if prompts is not None and not prompts.is_file():
        raise SpecPilotError(f"--prompts {prompts}: " + ("is a directory, not a file" if prompts.exists() else "not found"))
    if calibration is not None:  # its drafter learns each timed prompt's AR output untimed: no code candidates
        if agent is not None:
            raise SpecPilotError("--calibration and --agent: a simulated drafter is told each prompt's greedy output "
                                 "before the clock starts, which a code candidate could use; run them apart")
        from specpilot.spec.calibration import load_calibration

        load_calibration(calibration)  # a bad file: its one-line CalibrationError, before any measurement
    report = run_pilot(PilotOptions(target=tdir, drafter=ddir, out=out, quick=quick, device=device, dtype=dtype, seed=seed,
                           blocks=tuple(block or ()), eagle3=tuple(eagle3 or ()), adversarial=adversarial, threads=threads, memory=memory,
                           devices=devs, paired_devices=paired_devices, executor=executor, agent=agent,
                           agent_timeout=agent_timeout, scorer_dtype=scorer_dtype, calibration=calibration,
                           compile_cpu=compile_cpu, prompts=prompts, aligned=aligned,
                           overrides={k: v for k, v in (("per_benchmark", per_benchmark), ("max_new_tokens", max_new_tokens),
                                                        ("rounds", rounds)) if v is not None} or None))
    if isinstance(report, dict):  # the result on stdout (the console above is stderr): `pilot > result.txt` keeps it
        print(summary_line(report, out))


def summary_line(report: dict, out: Path) -> str:
    """The run's result in one line: the sealed system(s), speedup over AR (95% lower bound) and the report file."""
    if "per_size" in report:  # the batched pilot: one sealed system per size
        sizes = "; ".join(f"n={n}: {r['sealed_label']} {r['sealed_vs_ar']:.3f}x AR" for n, r in report["per_size"].items())
        return f"sealed {sizes}; report {out}/batch_report.md"
    low = report.get("speedup_ci_low")
    return (f"sealed {report['sealed_label']}: {report['speedup_vs_ar']:.3f}x AR"
            + (f" (lower bound {low:.3f})" if isinstance(low, (int, float)) else "") + f"; report {out}/report.md")

"""The ``specpilot calibrate`` command: a calibration of a real pair's drafter for the simulated ``calibrated`` drafter
(:mod:`specpilot.spec.calibration`, docs/calibrated-drafter.md). It records the drafter's lattice at every committed
length of the target's AR greedy outputs on bundled benchmark prompts (exact replay, §2.4), measures the calibration
from it and stores the drafter's cost spec and the target's Q-view agreement along the same outputs (TLV, §4.3), so
that ``specpilot pilot --calibration FILE`` or a ``calibrated`` SystemConfig on a random-weight target of a real shape
drafts with this pair's acceptance at this drafter's cost (and simulates the pair's Q agreement under TLV).
Registered by :mod:`specpilot.cli`; user errors are :class:`~specpilot.errors.SpecPilotError` (one line)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specpilot.errors import SpecPilotError, validation_message

KINDS = ("ngram", "draft_model", "block")


def calibrate_cmd(
    out: Path = typer.Option(..., help="Calibration file to write (JSON). Missing parent directories are created, as "
                             "pilot's and bench's --out are; a path under a file or in a place this user cannot "
                             "write is refused before any work."),
    drafter: str = typer.Option("draft_model", help="The real drafter: ngram | draft_model | block."),
    drafter_path: Optional[Path] = typer.Option(None, help="Its checkpoint directory (draft_model, block; default with the bundled target: the bundled draft model / block drafter)."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: bundled)."),
    per_benchmark: int = typer.Option(4, min=1, help="Bundled prompts per benchmark (GSM8K, HumanEval, MBPP, MT-Bench)."),
    max_new_tokens: int = typer.Option(64, min=2, help="AR tokens per prompt, the length of output the calibration fits (simulate outputs of about this length)."),
    depth: int = typer.Option(8, min=1, help="Positions per lattice (a block drafter: its block size at most)."),
    top_k: int = typer.Option(8, min=1, max=16, help="Candidates per position."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    device: str = typer.Option("cpu", help="torch device."),
):
    """Calibrate the simulated 'calibrated' drafter on a real pair (its acceptance and cost spec), for targets whose
    weights are random."""
    import torch

    from specpilot.config import SystemConfig
    from specpilot.data.benchmarks import load_mix
    from specpilot.engine.deployment import Deployment
    from specpilot.fileio import output_dir
    from specpilot.pilot.replay import record
    from specpilot.spec.calibration import calibrate, save_calibration
    from specpilot.spec.cost_drafter import cost_spec_of
    from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir

    if drafter not in KINDS:
        raise SpecPilotError(f"--drafter {drafter!r}: calibrate one of {', '.join(KINDS)}")
    if out.exists() and out.is_dir():
        raise SpecPilotError(f"--out {out} is a directory; give the calibration file's path")
    output_dir(out.parent, "--out's directory")
    if target is None and drafter_path is None and drafter != "ngram":
        drafter_path = bundled_drafter_dir() if drafter == "draft_model" else bundled_block_dir()
    if drafter != "ngram" and drafter_path is None:
        raise SpecPilotError(f"--drafter {drafter} needs --drafter-path with --target")
    try:  # before loading anything: a bad --depth or --dtype is named by its flag
        cfg = SystemConfig(drafter=drafter, drafter_path=str(drafter_path) if drafter == "block" else None,
                           tree="chain", depth=depth, nodes=depth, top_k=top_k, dtype=dtype)
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {validation_message(e)}") from None
    dep = Deployment(target or bundled_target_dir(), drafter_path if drafter == "draft_model" else None,
                     dtype=dtype, device=device, block_dirs=[drafter_path] if drafter == "block" else ())
    if dep.tokenizer is None:
        raise SpecPilotError(f"the target {dep.target_dir} has no tokenizer: calibrate needs the benchmark prompts")
    real = dep.system(cfg).drafter
    reqs = load_mix(per_benchmark, dep.tokenizer)
    prompts = [dep.tokenizer(r.text, add_special_tokens=False)["input_ids"] for r in reqs]
    ar_engine = dep.system(SystemConfig.ar(dtype=dtype), eos_ids=[])
    with torch.inference_mode():
        ar = [ar_engine.generate(p, max_new_tokens).tokens for p in prompts]
    rec = record(real, prompts, ar, depth, top_k, target=dep.target)  # used by drafters that read target features
    cal = calibrate(rec, cost=cost_spec_of(real), source={
        "drafter": drafter, "drafter_path": str(drafter_path) if drafter_path else None,
        "target": str(dep.target_dir), "requests": len(prompts), "max_new_tokens": max_new_tokens, "dtype": dtype})
    q_note = q_agreement_of(dep.target, rec, cal)
    path = save_calibration(cal, out)
    print(f"wrote {path} ({len(prompts)} requests x {max_new_tokens} tokens, depth {depth}, top-{top_k}; "
          f"cost {cal.cost['kind'] if cal.cost else 'none'}; {q_note})")


def q_agreement_of(target, rec, cal) -> str:
    """Store in ``cal`` the real pair's Q-view (``view8``) agreement along ``rec``'s AR outputs (TLV, §4.3), so a
    calibrated system's TLV Q pass can be simulated (:mod:`specpilot.spec.calibrated_q`); returns a line for the
    user. A target without a Q view (a hybrid) leaves it unset and says so."""
    from specpilot.model.qview import q_view
    from specpilot.pilot.replay_tlv import record_q
    from specpilot.spec.calibrated_q import measure_q_agreement

    try:
        q = q_view(target, "view8")
    except SpecPilotError as e:
        return f"no Q agreement ({e})"
    qrec = record_q(target, q, rec, cal.depth, "view8")
    cal.q_agreement = measure_q_agreement(rec.ar, qrec.chains, cal.depth, "view8")
    return f"view8 Q agreement {qrec.agreement(rec)['root']:.3f} of root rows"

"""``specpilot audit``: token forcing (§3.4) of outputs produced by any engine.

Input is a JSONL file, one request per line: ``{"prompt_ids": [...], "output_ids": [...]}`` with an
optional ``"benchmark"`` name (other keys are ignored). Every output is teacher-forced through the
target checkpoint with an FP32 LM head (:class:`~specpilot.pilot.forcing.Scorer`); mismatches, their
margins and events (margin >= 2δ) are counted overall and per benchmark, and the two reject rules of
§3.4 are applied against a baseline:

- with ``reference`` (a JSONL file of the same form, e.g. the stock engine's outputs in the same
  precision), the baseline is that file's figures under the same scorer and δ — the paper's rule;
- without it, the baseline is the scorer itself (zero mismatches, zero events): then any event, or a
  mismatch rate above 0.5%, rejects. Right for float32 engines; a bf16 engine's near-ties (the paper's
  stock: 0.72% of tokens) need a reference.

Outputs holding no token at all (every ``output_ids`` empty) are rejected: nothing was audited.

δ is the caller's (Phase 0 of a pilot run on that deployment sets it, ``report.json`` -> ``phase0.delta``)
or the floor 1/8 nat, the value Phase 0 gives when stock never diverges from AR.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from specpilot.errors import SpecPilotError
from specpilot.pilot.forcing import DELTA_STEP, ForcingStats, Scorer, audit, forcing_verdict

DEFAULT_DELTA = DELTA_STEP  # the floor of δ (§3.4)


class AuditInputError(SpecPilotError):
    """An outputs file is missing, empty or malformed, or holds token ids the target cannot score."""


class OutputLine(BaseModel):
    """One line of an outputs file: ``prompt_ids`` (non-empty), ``output_ids``, optional ``benchmark``."""

    model_config = ConfigDict(extra="ignore")
    prompt_ids: list[StrictInt] = Field(min_length=1)
    output_ids: list[StrictInt]
    benchmark: StrictStr = "all"


def read_outputs(path: str | Path, vocab_size: int, max_len: int,
                 what: str = "outputs") -> list[tuple[list[int], list[int], str]]:
    """Parse and check an outputs JSONL file (blank lines are skipped).

    Args:
        path: the file. vocab_size: ids must lie in ``[0, vocab_size)``. max_len: the most tokens
            (prompt + output) the target can score. what: the file's role in messages (``outputs``,
            ``reference``).
    Returns:
        ``(prompt_ids, output_ids, benchmark)`` per line, in file order.
    Raises:
        AuditInputError: missing/unreadable file, no lines, a line that is not a JSON object of the
            documented form, an id out of the vocabulary, or a line longer than ``max_len`` (each message
            names the file and line number).
    """
    p = Path(path)
    if not p.is_file():
        raise AuditInputError(f"{what} file {p} is a directory" if p.is_dir() else f"{what} file not found: {p}")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AuditInputError(f"cannot read {p}: {e}") from None
    out = []
    for no, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{p}, line {no}"
        try:
            row = OutputLine.model_validate(json.loads(text))
        except json.JSONDecodeError as e:
            raise AuditInputError(f"{where}: not JSON ({e.msg})") from None
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "line"
            raise AuditInputError(f"{where}: {loc}: {err['msg']}") from None
        for key in ("prompt_ids", "output_ids"):
            bad = next((t for t in getattr(row, key) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise AuditInputError(f"{where}: {key} holds id {bad}, outside the target's vocabulary [0, {vocab_size})")
        if len(row.prompt_ids) + len(row.output_ids) > max_len:
            raise AuditInputError(f"{where}: prompt + output = {len(row.prompt_ids) + len(row.output_ids)} tokens, "
                                  f"more than the target's context of {max_len}")
        out.append((row.prompt_ids, row.output_ids, row.benchmark))
    if not out:
        raise AuditInputError(f"{p} holds no outputs")
    return out


def write_outputs(path: str | Path, samples) -> Path:
    """Write audited outputs as the JSONL that :func:`read_outputs` (``specpilot audit --outputs``) reads: one
    ``{"prompt_ids", "output_ids", "benchmark"}`` line per ``(prompt_ids, output_ids, benchmark)`` sample, so a
    pilot's verdict can be re-audited later (e.g. with another δ or ``--reference``).

    Returns:
        The path written. Raises: OSError when it cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt_ids": [int(t) for t in p], "output_ids": [int(t) for t in o], "benchmark": b})
             for p, o, b in samples]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def audit_outputs(target: str | Path, outputs: str | Path, delta: float | None = None,
                  reference: str | Path | None = None, device: str = "cpu", dtype: str = "float32") -> dict:
    """Token-force the outputs in ``outputs`` against the checkpoint ``target`` (§3.4).

    Args:
        target: HF checkpoint directory of the target (the scorer: its weights, FP32 LM head).
        outputs: the JSONL file to audit (see the module doc).
        delta: near-tie threshold δ in nats (> 0); default 1/8.
        reference: optional JSONL file of a reference engine's outputs (the baseline of both rules).
        device / dtype: where and in which dtype the scorer's target runs (the head is always FP32).
    Returns:
        JSON-ready dict: ``target``, ``outputs``, ``delta``, ``event_margin`` (2δ), ``audited``
        (:meth:`ForcingStats.to_dict`: tokens, mismatches, events, rates, top margins, per benchmark),
        ``baseline`` (the same figures of the reference, or zeros) and ``baseline_kind``, ``passed``,
        ``reasons`` (every failed rule).
    Raises:
        AuditInputError: bad outputs / reference file (one whose every ``output_ids`` is empty included: 0 tokens
            give no verdict and no baseline) or ``delta`` not finite and > 0.
        CheckpointError: the target cannot be loaded.
    """
    from specpilot.model.checkpoint import load_model

    delta = DEFAULT_DELTA if delta is None else float(delta)
    if not (delta > 0 and math.isfinite(delta)):  # inf would switch the event rule off
        raise AuditInputError(f"--delta must be a finite number > 0 nats, got {delta}")
    model = load_model(target, dtype, device)
    vocab, ctx = model.args.vocab_size, model.args.max_position_embeddings
    rows = read_outputs(outputs, vocab, ctx)
    ref_rows = read_outputs(reference, vocab, ctx, "reference") if reference is not None else None
    if not any(out for _, out, _ in rows):  # a verdict on nothing would vouch for nothing: bad input, not a reject
        raise AuditInputError(f"--outputs {outputs}: all {len(rows)} output_ids are empty (0 tokens), so there is "
                              "nothing to audit; give the engine's outputs with their tokens")
    if ref_rows is not None and not any(out for _, out, _ in ref_rows):  # "0.00%" would read as if measured
        raise AuditInputError(f"--reference {reference}: all {len(ref_rows)} output_ids are empty (0 tokens), so it "
                              "gives no baseline; pass a reference with tokens, or none (the scorer's zero baseline)")
    scorer = Scorer(model)
    stats = audit(scorer, rows, delta)
    base = audit(scorer, ref_rows, delta) if ref_rows is not None else ForcingStats(delta=delta)
    passed, reasons = forcing_verdict(stats, base, "the reference" if ref_rows is not None else "the scorer")
    return {
        "target": str(target), "outputs": str(outputs), "lines": len(rows), "delta": delta, "event_margin": 2 * delta,
        "audited": stats.to_dict(), "baseline": base.to_dict(),
        "baseline_kind": f"reference {reference}" if reference is not None else "scorer argmax (zero mismatches, zero events)",
        "passed": passed, "reasons": reasons,
    }


def render(res: dict, console) -> None:
    """Print an audit result (from :func:`audit_outputs`) as a table and a verdict line on ``console``."""
    from rich.table import Table

    a = res["audited"]
    console.print(f"audited {res['lines']} outputs, {a['tokens']} tokens against {res['target']} "
                  f"(δ = {res['delta']:g} nat; events: margin >= {res['event_margin']:g})")
    t = Table("benchmark", "tokens", "mismatches", "mismatch rate", "events", "event rate")
    per = a["per_benchmark"]
    for name, b in sorted(per.items()):
        if name == "all" and len(per) == 1:
            continue  # lines without a benchmark field: the total row below says it
        t.add_row(name, str(b["tokens"]), str(b["mismatches"]), f"{b['mismatch_rate']:.2%}", str(b["events"]),
                  f"{b['event_rate']:.3%}")
    t.add_row("all", str(a["tokens"]), str(a["mismatches"]), f"{a['mismatch_rate']:.2%}", str(a["events"]),
              f"{a['event_rate']:.3%}", style="bold")
    console.print(t)
    b = res["baseline"]
    console.print(f"baseline: {res['baseline_kind']}: mismatch rate {b['mismatch_rate']:.2%}, "
                  f"event rate {b['event_rate']:.3%}")
    if a["top_margins"]:
        console.print("largest mismatch margins (nat): " + ", ".join(f"{m:.3f}" for m in a["top_margins"]))
    console.print("verdict: passed" if res["passed"] else "verdict: REJECTED: " + "; ".join(res["reasons"]))

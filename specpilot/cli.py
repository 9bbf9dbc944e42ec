"""The ``specpilot`` command line: generate, pilot, zoo.

Every user error (:class:`~specpilot.errors.SpecPilotError`) is printed as one line ``error: ...`` on
stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import SpecPilotError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lossless speculative decoding, tuned per deployment.")


def _zoo_app():
    from .zoo.cli import app as zoo

    return zoo


app.add_typer(_zoo_app(), name="zoo", help="Bundled default models: paths and the training recipe.")


def _default_dirs(target: Optional[Path], drafter: str, drafter_path: Optional[Path]):
    from .zoo import bundled_drafter_dir, bundled_target_dir

    if target is None:
        target = bundled_target_dir()
        if drafter == "draft_model" and drafter_path is None:
            drafter_path = bundled_drafter_dir()
    if drafter == "draft_model" and drafter_path is None:
        raise SpecPilotError("--drafter draft_model needs --drafter-path DIR with a target other than the bundled one")
    return target, (drafter_path if drafter == "draft_model" else None)


@app.command()
def generate(
    prompt: str = typer.Option(..., help="Prompt text."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: the bundled target)."),
    drafter: str = typer.Option("ngram", help="none | ngram | draft_model"),
    drafter_path: Optional[Path] = typer.Option(None, help="Draft model checkpoint directory."),
    tree: str = typer.Option("chain", help="chain | best_first"),
    nodes: int = typer.Option(6, help="Tree budget N (drafted nodes per exact pass)."),
    depth: int = typer.Option(6, help="Draft positions per step."),
    top_k: int = typer.Option(4, help="Candidates per draft position."),
    max_new_tokens: int = typer.Option(64, help="Most tokens to generate."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the tokenizer's chat template."),
    device: str = typer.Option("cpu", help="torch device."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Greedy-decode one prompt with a speculative system (output equals AR greedy decoding)."""
    from .config import SystemConfig
    from .engine.deployment import Deployment

    if drafter not in ("none", "ngram", "draft_model"):
        raise SpecPilotError(f"unknown drafter {drafter!r} (choose none, ngram or draft_model)")
    if tree not in ("chain", "best_first"):
        raise SpecPilotError(f"unknown tree builder {tree!r} (choose chain or best_first)")
    try:
        cfg = SystemConfig(drafter=drafter, tree=tree, nodes=nodes, depth=depth,
                           top_k=1 if tree == "chain" else top_k, dtype=dtype)
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {str(e).splitlines()[-1].strip()}") from None
    tdir, ddir = _default_dirs(target, drafter, drafter_path)
    dep = Deployment(tdir, ddir, dtype=dtype, device=device)
    tok = dep.tokenizer
    if not prompt.strip():
        raise SpecPilotError("the prompt is empty")
    if chat and tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    gen = dep.system(cfg).generate(ids, max_new_tokens)
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    if as_json:
        print(json.dumps({
            "tokens": gen.tokens, "text": text, "tau": round(gen.tau, 4), "steps": gen.steps,
            "accepted": gen.accepted, "stop_reason": gen.stop_reason, "tokens_per_s": round(gen.tokens_per_s, 2),
            "system": cfg.model_dump(), "target": str(tdir),
        }))
    else:
        print(text)
        print(f"[{len(gen.tokens)} tokens, {gen.steps} exact passes, tau {gen.tau:.2f}, "
              f"{gen.tokens_per_s:.1f} tok/s, stop: {gen.stop_reason}]", file=sys.stderr)


@app.command()
def pilot(
    quick: bool = typer.Option(False, help="Smoke run (about 3 minutes on 2 CPU cores)."),
    out: Path = typer.Option(Path("specpilot-report"), help="Report directory."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: bundled)."),
    drafter_path: Optional[Path] = typer.Option(None, help="Draft model directory (default: bundled drafter with the bundled target)."),
    device: str = typer.Option("cpu", help="torch device."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    seed: int = typer.Option(0, help="Seed for request sampling and bootstrap."),
):
    """Run the SpecPilot procedure (§3): Phase 0, cost model, planner, controller, token forcing, seal."""
    from .pilot.run import PilotOptions, run_pilot

    tdir, ddir = target, drafter_path
    if tdir is None:
        from .zoo import bundled_drafter_dir, bundled_target_dir

        tdir, ddir = bundled_target_dir(), ddir or bundled_drafter_dir()
    run_pilot(PilotOptions(target=tdir, drafter=ddir, out=out, quick=quick, device=device, dtype=dtype, seed=seed))


def main() -> None:
    """Console entry point: runs the Typer app, turning SpecPilotError into a one-line error."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # our own errors say what matters
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        app(standalone_mode=False)
    except SpecPilotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:  # click usage errors in non-standalone mode
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()

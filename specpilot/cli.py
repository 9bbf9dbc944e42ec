"""The ``specpilot`` command line: generate, pilot, audit, memory, replay, bench, train-drafter, calibrate, zoo,
w12, import-gguf.

Thin: parse, check, call, print; ``pilot``, ``bench``, ``serve`` and the sub-apps (``zoo``, ``w12``, ``memory``)
live beside what they run. Every user error (:class:`~specpilot.errors.SpecPilotError`, and text that is not valid
UTF-8) is printed as one line ``error: ...`` on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from specpilot.bench.cli import bench, check_float16_device
from specpilot.errors import SpecPilotError, validation_message
from specpilot.fileio import output_dir
from specpilot.pilot.cli import pilot_cmd
from specpilot.pilot.memory_cli import app as memory_app
from specpilot.serve.cli import serve
from specpilot.spec.calibrate_cli import calibrate_cmd
from specpilot.spec.train_cli import train_drafter_cmd
from specpilot.w12.cli import app as w12_app
from specpilot.zoo.cli import app as zoo_app, import_gguf

# plain click help (rich_markup_mode=None): it wraps help text where rich tables cut long flags at 80 columns
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Lossless speculative decoding, tuned per deployment.")
app.add_typer(zoo_app, name="zoo", help="Bundled default models: paths, the training recipe; SmolLM2 from its GGUF.")
app.add_typer(w12_app, name="w12", help="W12 lossless 12-bit weights: pack and verify checkpoint directories.")
app.add_typer(memory_app, name="memory", help="Memory of verified entries (§3.5): list, show, check.")
app.command()(bench)
app.command()(serve)
app.command("pilot")(pilot_cmd)
app.command("import-gguf")(import_gguf)
app.command("calibrate")(calibrate_cmd)
app.command("train-drafter")(train_drafter_cmd)
CHECKPOINT_DRAFTERS = ("draft_model", "block", "eagle3")  # the drafters read from --drafter-path


def _default_dirs(target: Optional[Path], drafter: str, drafter_path: Optional[Path]):
    from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

    from specpilot.zoo import bundled_block_dir

    if target is None:
        target = bundled_target_dir()
        if drafter == "draft_model" and drafter_path is None:
            drafter_path = bundled_drafter_dir()
        if drafter == "block" and drafter_path is None:
            drafter_path = bundled_block_dir()
    if drafter in CHECKPOINT_DRAFTERS and drafter_path is None:  # eagle3 has no bundled drafter
        raise SpecPilotError(f"--drafter {drafter} needs --drafter-path DIR" + (
            "" if drafter == "eagle3" else " with a target other than the bundled one"))
    if drafter in CHECKPOINT_DRAFTERS:
        check_drafter_kind(drafter, drafter_path)
    return target, (drafter_path if drafter in CHECKPOINT_DRAFTERS else None)


def drafter_kind(path: Path) -> Optional[str]:
    """The kind of drafter checkpoint directory ``path``, read from its ``config.json``: ``"block"`` or
    ``"block_markov"`` (a block drafter: ``"specpilot_drafter": "block"``), ``"eagle3"`` (ours or a public EAGLE-3
    head: :func:`~specpilot.spec.eagle3.is_eagle3_dir`), ``"draft_model"`` (a causal LM
    with a ``model_type``), or None when there is no readable config.json. Raises nothing."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if cfg.get("specpilot_drafter") == "block":
        return "block_markov" if cfg.get("kind") == "block_markov" or cfg.get("markov_rank", 0) else "block"
    from specpilot.spec.eagle3 import is_eagle3_dir

    if is_eagle3_dir(path):  # before model_type: public EAGLE-3 heads declare model_type llama
        return "eagle3"
    from specpilot.spec.dflash_import import is_dflash_dir

    if is_dflash_dir(path):  # a public DFlash drafter, loaded as a block drafter (it declares model_type qwen3)
        return "block"
    return "draft_model" if cfg.get("model_type") else None


def check_drafter_kind(drafter: str, path: Path) -> None:
    """Check that ``--drafter-path path`` holds the kind of drafter ``--drafter drafter`` (``draft_model``,
    ``block`` or ``eagle3``) asks for.

    Raises:
        SpecPilotError: one line saying what the directory holds and which ``--drafter`` to use (a directory
            without a readable config.json is left to the loader, which names the missing file).
    """
    kind = drafter_kind(path)
    if kind is None:
        return
    if drafter == "draft_model" and kind in ("block", "block_markov"):
        raise SpecPilotError(f"--drafter-path {path} is a block drafter (kind {kind}, from its config.json), "
                             "not a draft model: use --drafter block (pilot: --block)")
    if (kind == "eagle3") != (drafter == "eagle3"):
        raise SpecPilotError(f"--drafter-path {path} holds a drafter of kind {kind} (from its config.json), not "
                             f"{drafter}: use --drafter {'block' if kind.startswith('block') else kind} (pilot: "
                             f"--{'block' if kind.startswith('block') else kind})")
    if drafter == "block" and kind == "draft_model":
        mt = json.loads((Path(path) / "config.json").read_text()).get("model_type")
        raise SpecPilotError(f"--drafter-path {path} is a draft model (model_type {mt}, from its config.json), "
                             "not a block drafter: use --drafter draft_model")


@app.command()
def generate(
    prompt: str = typer.Option(..., help="Prompt text."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: the bundled target)."),
    drafter: str = typer.Option("ngram", help="none | ngram | draft_model | block | eagle3"),
    drafter_path: Optional[Path] = typer.Option(None, help="Draft model, block or EAGLE-3 drafter checkpoint directory."),
    tree: str = typer.Option("chain", help="chain | best_first | ddtree_marginal | eagle2_topk | sequoia"),
    nodes: int = typer.Option(6, help="Tree budget N (drafted nodes per exact pass)."),
    depth: int = typer.Option(6, help="Draft positions per step."),
    top_k: int = typer.Option(4, help="Candidates per draft position."),
    max_new_tokens: int = typer.Option(64, help="Most tokens to generate."),
    tlv: bool = typer.Option(False, help="Two-level verification (§4.3): a Q pass over approximate weights picks a "
                                         "chain, a second draft hangs under it, one exact pass verifies both."),
    q_weights: str = typer.Option("view8", help="The Q pass's weights with --tlv: view8 (W12's 8-bit view) | int8 | "
                                                "int6."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the tokenizer's chat template."),
    device: str = typer.Option("cpu", help="torch device."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: as the pilot picks them: 1 on a CPU "
                                          "device with <= 2 cores, where 2 threads made an AR step 4x slower on a "
                                          "loaded machine; else torch's default)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (one line; with prompt_ids and output_ids, so it is a line `specpilot audit --outputs` reads)."),
):
    """Greedy-decode one prompt with a speculative system (output equals AR greedy decoding)."""
    import torch

    from specpilot.config import SystemConfig
    from specpilot.engine.deployment import Deployment
    from specpilot.pilot.setup import available_cores, choose_threads
    from specpilot.spec.trees import BUILDERS
    from specpilot.text import check_text, encode_text

    if drafter not in ("none", "ngram", *CHECKPOINT_DRAFTERS):
        raise SpecPilotError(f"unknown drafter {drafter!r} (choose none, ngram, draft_model, block or eagle3)")
    if tree not in BUILDERS:
        raise SpecPilotError(f"unknown tree builder {tree!r} (choose {', '.join(BUILDERS)})")
    if top_k < 1:  # a chain ignores --top-k (it takes 1), but a bad value is still refused, not dropped
        raise SpecPilotError(f"invalid option: --top-k must be at least 1, got {top_k}")
    if max_new_tokens < 1:  # before loading anything, named by its flag
        raise SpecPilotError(f"invalid option: --max-new-tokens must be at least 1, got {max_new_tokens}")
    if not check_text(prompt, "--prompt"):  # whitespace is text (it has tokens); only nothing is empty
        raise SpecPilotError("the prompt is empty")
    if drafter == "none" and tree != "chain":
        raise SpecPilotError(f"--tree {tree} needs a drafter: --drafter none is plain AR decoding")
    try:
        n_threads, _ = choose_threads(device, threads, available_cores(), torch.get_num_threads())
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {e}") from None
    try:
        cfg = SystemConfig(drafter=drafter, tree=tree, nodes=nodes, depth=depth,
                           top_k=1 if tree == "chain" else top_k, dtype=dtype, tlv=tlv, q_weights=q_weights)
    except ValueError as e:
        raise SpecPilotError(f"invalid option: {validation_message(e)}") from None
    if drafter_path is not None and drafter in ("none", "ngram"):
        raise SpecPilotError(f"--drafter-path is for --drafter draft_model, block or eagle3; drafter {drafter!r} reads no "
                             "checkpoint")
    tdir, ddir = _default_dirs(target, drafter, drafter_path)
    if ddir is not None:
        cfg = cfg.model_copy(update={"drafter_path": str(ddir)})
    torch.set_num_threads(n_threads)  # before loading: the load's own work runs on these threads too
    dep = Deployment(tdir, ddir, dtype=dtype, device=device)
    tok = dep.tokenizer
    if tok is None:
        raise SpecPilotError(f"{tdir} has no tokenizer files, so a text prompt cannot be encoded (random-weight "
                             "checkpoints are for `specpilot bench` and `specpilot pilot`, which feed token ids)")
    if chat and tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = encode_text(tok, prompt, "--prompt")
    gen = dep.system(cfg).generate(ids, max_new_tokens)
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    if as_json:
        print(json.dumps({
            "prompt_ids": ids, "output_ids": gen.tokens, "tokens": gen.tokens, "text": text, "tau": round(gen.tau, 4), "steps": gen.steps,
            "accepted": gen.accepted, "stop_reason": gen.stop_reason, "tokens_per_s": round(gen.tokens_per_s, 2),
            "system": cfg.model_dump(), "target": str(tdir), "threads": n_threads,
        }))
    else:
        print(text)
        print(f"[{len(gen.tokens)} tokens, {gen.steps} exact passes, tau {gen.tau:.2f}, "
              f"{gen.tokens_per_s:.1f} tok/s, stop: {gen.stop_reason}]", file=sys.stderr)


@app.command()
def audit(
    target: Path = typer.Option(..., help="Target checkpoint directory (the scorer: its weights, FP32 LM head)."),
    outputs: Path = typer.Option(..., help="JSONL file, one {\"prompt_ids\": [...], \"output_ids\": [...]} per line (optional \"benchmark\")."),
    delta: Optional[float] = typer.Option(None, help="Near-tie threshold δ in nats (default: the floor 1/8)."),
    reference: Optional[Path] = typer.Option(None, help="Reference engine's outputs (same form) as the baseline of both rules; default: the scorer (zero mismatches)."),
    device: str = typer.Option("cpu", help="torch device of the scorer."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16 (the LM head is FP32 in any case)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Token forcing (§3.4) of any engine's outputs: mismatches, events (margin >= 2δ), both reject rules.

    Exit status 0 when the outputs pass, 1 when they are rejected, 2 on bad input (outputs without a token to
    audit included).
    """
    from specpilot.engine.deployment import check_device
    from specpilot.pilot.audit import audit_outputs, render

    if dtype not in ("float32", "bfloat16", "float16"):
        raise SpecPilotError(f"--dtype: unknown dtype {dtype!r} (choose float32, bfloat16 or float16)")
    res = audit_outputs(target, outputs, delta, reference, check_device(device), dtype)
    if as_json:
        print(json.dumps(res))
    else:
        from rich.console import Console

        render(res, Console())
    if not res["passed"]:
        raise typer.Exit(1)


@app.command()
def replay(
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: bundled)."),
    drafter: Optional[List[Path]] = typer.Option(None, help="Block or EAGLE-3 drafter directories (default: bundled block + block_markov); the n-gram drafter is always in the table."),
    per_benchmark: int = typer.Option(4, help="Prompts per bundled benchmark."),
    max_new_tokens: int = typer.Option(64, help="AR tokens per prompt."),
    out: Path = typer.Option(Path("specpilot-replay"), help="Directory for table.md, table.json and tau.png."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as a JSON list of rows."),
    tlv: Optional[List[str]] = typer.Option(None, help="Also replay TLV (§4.3) with these Q-pass weights (view8, int8, "
                                            "int6; repeatable): tokens per exact pass, and the Q pass's agreement in "
                                            "tlv.json."),
):
    """Exact replay (§2.4, §4.2): τ of chain / best_first / eagle2_topk / sequoia / ddtree_marginal / oracle (and TLV)."""
    from specpilot.pilot.replay_table import replay_table
    from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir, bundled_target_dir

    if per_benchmark < 1:
        raise SpecPilotError(f"--per-benchmark must be at least 1 (prompts per bundled benchmark), got {per_benchmark}")
    if max_new_tokens < 1:
        raise SpecPilotError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    bad = [w for w in tlv or [] if w not in ("view8", "int8", "int6")]
    if bad:
        raise SpecPilotError(f"--tlv takes view8, int8 or int6, got {', '.join(bad)}")
    dirs = list(drafter) if drafter else [bundled_block_dir(), bundled_block_markov_dir()]
    rows, md = replay_table(target or bundled_target_dir(), dirs, per_benchmark, max_new_tokens, output_dir(out, "--out"),
                            tlv=tuple(dict.fromkeys(tlv or [])))
    print(json.dumps(rows) if as_json else md)


def main() -> None:
    """Console entry point: runs the Typer app, turning SpecPilotError into a one-line error."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # our own errors say what matters
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit(n) comes back as n in this mode
    except SpecPilotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except UnicodeError as e:  # text a command did not check itself (e.g. a file it read) is not UTF-8
        print(f"error: not valid UTF-8: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:  # usage errors of the parser (click's or typer's vendored click) in non-standalone mode
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            if type(e).__name__ == "NoArgsIsHelpError" or not hasattr(e, "format_message"):
                e.show()  # the help text itself
            else:  # one line, as every other error: click's usage block is four
                ctx = getattr(e, "ctx", None)
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                print(f"error: {e.format_message()}{hint}", file=sys.stderr)
            sys.exit(e.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()

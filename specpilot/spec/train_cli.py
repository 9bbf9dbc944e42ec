"""The ``specpilot train-drafter`` command: train a block, block_markov or eagle3 drafter on the target's own greedy
continuations (:func:`specpilot.spec.train_block.train_drafter`). Registered by :mod:`specpilot.cli`; user errors
are :class:`~specpilot.errors.SpecPilotError` (one line, exit status 2 there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from specpilot.errors import SpecPilotError
from specpilot.fileio import output_dir


def train_drafter_cmd(
    kind: str = typer.Option("block", help="block | block_markov | eagle3"),
    block: int = typer.Option(16, min=2, max=32, help="Block size B (positions drafted per pass), 2-32."),
    out: Path = typer.Option(..., help="Output directory (config.json + model.safetensors + provenance)."),
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: bundled)."),
    tokens: Path = typer.Option(Path("work/zoo/tokens.npy"), help="Training tokens (specpilot zoo tokenize)."),
    steps: int = typer.Option(600, min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(16, min=1, help="Sequences per step."),
    anchors: int = typer.Option(4, min=1, help="Anchor positions (blocks) per sequence."),
    lr: float = typer.Option(2e-3, min=1e-12, help="Peak learning rate (> 0)."),
    n_seqs: int = typer.Option(1536, min=1, help="Training-text snippets continued greedily by the target."),
    prompt_len: int = typer.Option(32, min=1, help="Tokens of training text per snippet (the prompt the target continues)."),
    gen_len: int = typer.Option(80, min=1, help="Greedy tokens generated per snippet."),
    markov_rank: int = typer.Option(16, min=1, help="Rank of the Markov head (block_markov)."),
    target_layers: Optional[str] = typer.Option(None, help="Comma-separated 0-based target layers the drafter reads (default: 1, L/2 and L-1 of the target's L layers)."),
    data_cache: Optional[Path] = typer.Option(None, help="Cache file for the generated data (.pt)."),
    device: str = typer.Option("cpu", help="torch device (cpu, cuda)."),
    seed: int = typer.Option(0, help="Seed."),
    quiet: bool = typer.Option(False, help="No progress bars (ours, and transformers' while it loads the target)."),
    draft_vocab: Optional[int] = typer.Option(None, min=1, help="Draft vocabulary size: the most frequent target ids of the training data (eagle3 default: min(vocab, 32000); block default: the whole vocabulary)."),
    ttt_steps: int = typer.Option(4, min=1, help="eagle3: training-time-test steps (the drafter unrolled on its own hidden states)."),
    max_seconds: Optional[float] = typer.Option(None, min=1, help="Wall-time budget of the optimizer loop: after 10 timed steps the run is shortened to fit (schedule included)."),
):
    """Train a block drafter (DFlash-style; block_markov: + DSpark Markov head) or an EAGLE-3 drafter (eagle3) on
    the target's greedy outputs."""
    import shlex

    from specpilot.spec.train_block import train_drafter
    from specpilot.zoo import bundled_target_dir

    from specpilot.engine.deployment import check_device

    check_device(device)
    output_dir(out, "--out")
    layers = None
    if target_layers is not None:
        try:
            layers = tuple(int(x) for x in target_layers.split(","))
        except ValueError:
            raise SpecPilotError(f"--target-layers takes comma-separated integers, got {target_layers!r}") from None
    cmd = "specpilot " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    prov = train_drafter(target or bundled_target_dir(), out, kind=kind, block=block, steps=steps,
                         batch_size=batch_size, anchors=anchors, lr=lr, n_seqs=n_seqs, prompt_len=prompt_len, gen_len=gen_len,
                         markov_rank=markov_rank, target_layers=layers, seed=seed, tokens_path=tokens, device=device,
                         command=cmd, quiet=quiet, data_cache=data_cache, draft_vocab_size=draft_vocab,
                         ttt_steps=ttt_steps, max_seconds=max_seconds)
    keys = ("kind", "block_size", "parameters", "initial_heldout_loss", "final_heldout_loss",
            "final_heldout_top1_acc_pos0", "eagle3")
    print(json.dumps({k: prov[k] for k in keys if k in prov}))

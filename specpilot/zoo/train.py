"""Train the bundled target or drafter: a small Qwen3-architecture causal LM (``transformers.Qwen3ForCausalLM``).

Random contiguous windows of a pre-tokenized ``uint16`` array, AdamW, linear warmup then cosine decay,
bf16 autocast on CUDA and float32 on the CPU, everything seeded. The output directory is a standard
Hugging Face checkpoint in bfloat16 (config.json, model.safetensors, tokenizer files) plus
``provenance.json`` and ``loss.png``.
"""

from __future__ import annotations

from specpilot.provenance import git_commit  # noqa: F401  (re-exported for the recipe)

import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.errors import SpecPilotError

PRESETS: dict[str, dict] = {
    "target": dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=64, num_key_value_heads=2,
        intermediate_size=768,
    ),
    "drafter": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, head_dim=64, num_key_value_heads=1,
        intermediate_size=384,
    ),
}
COMMON = dict(
    tie_word_embeddings=True, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False, initializer_range=0.02,
)


def make_config(preset: str, vocab_size: int, eos_token_id: int, overrides: dict | None = None):
    """``transformers.Qwen3Config`` for a preset.

    Args:
        preset: ``target`` or ``drafter`` (see :data:`PRESETS`).
        vocab_size: tokenizer vocabulary size (both presets share the tokenizer).
        eos_token_id: id of ``<|endoftext|>`` (also used as pad).
        overrides: config fields to replace (e.g. a tiny model in tests).
    Raises:
        SpecPilotError: unknown preset.
    """
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise SpecPilotError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    kw = {**COMMON, **PRESETS[preset], **(overrides or {})}
    return Qwen3Config(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=eos_token_id, bos_token_id=None, **kw)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Learning rate at 0-based ``step``: linear warmup over ``warmup`` steps, then cosine to ``min_ratio*lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def load_tokens(path: str | Path) -> tuple[np.ndarray, dict]:
    """``[n] uint16`` tokens from ``tokens.npy`` and the metadata of its sibling ``tokens.json`` (``{}`` if absent).

    Raises:
        SpecPilotError: missing file or wrong dtype.
    """
    p = Path(path)
    if not p.is_file():
        raise SpecPilotError(f"token file not found: {p} (run `specpilot zoo tokenize` first)")
    arr = np.load(p)
    if arr.dtype != np.uint16 or arr.ndim != 1:
        raise SpecPilotError(f"{p}: expected a 1-D uint16 array, got {arr.dtype} {arr.shape}")
    mp = p.with_suffix(".json")
    return arr, (json.loads(mp.read_text()) if mp.is_file() else {})


def _batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len + 1] long`` random contiguous windows of ``data``."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return data[idx.to(data.device)]


def plot_loss(losses: list[float], path: Path, title: str, val: list[tuple[int, float]] = ()) -> None:
    """Write the training-loss curve (and held-out points) to ``path`` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.5, label="train (per step)")
    k = max(1, min(50, len(losses) // 10))
    if len(losses) >= k:
        sm = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), sm, lw=1.5, label=f"train ({k}-step mean)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(
    tokens: str | Path,
    tokenizer: str | Path,
    out: str | Path,
    preset: str = "target",
    steps: int = 4000,
    batch_size: int = 64,
    seq_len: int = 256,
    lr: float = 3e-3,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    device: str = "auto",
    seed: int = 0,
    overrides: dict | None = None,
    time_limit_s: float | None = None,
    eval_every: int = 500,
    val_fraction: float = 0.01,
    compile: bool = False,
    command: str | None = None,
    quiet: bool = False,
) -> dict:
    """Train a preset model and save it as a bfloat16 Hugging Face checkpoint directory.

    Args:
        tokens: ``tokens.npy`` (``[n] uint16``); its sibling ``tokens.json`` supplies data provenance.
        tokenizer: tokenizer directory (its files are copied into ``out``).
        out: output checkpoint directory (created; existing files overwritten).
        preset: ``target`` or ``drafter``.
        steps: optimizer steps.
        batch_size: sequences per step.
        seq_len: tokens per sequence (each window holds seq_len + 1 tokens).
        lr: peak learning rate; warmup: warmup steps (default min(200, steps // 10)).
        weight_decay: AdamW decay on matrices (not on norms).
        device: ``auto`` (cuda if available), ``cpu``, ``cuda``, ``cuda:1``...
        seed: seeds Python, NumPy, torch and the batch sampler.
        overrides: Qwen3Config fields replacing the preset's.
        time_limit_s: stop early (and still save) after this many seconds of training.
        eval_every: steps between held-out evaluations (the last `val_fraction` of the tokens).
        compile: ``torch.compile`` the model (CUDA only).
        command: command line recorded in provenance (default ``sys.argv``).
        quiet: no progress bar.
    Returns:
        The provenance dict (also written to ``out/provenance.json``).
    Raises:
        SpecPilotError: missing inputs, too few tokens for ``seq_len``, unknown preset.
    """
    import transformers
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    t_start = time.time()
    arr, tok_meta = load_tokens(tokens)
    tok_dir = Path(tokenizer)
    if not (tok_dir / "tokenizer.json").is_file():
        raise SpecPilotError(f"no tokenizer.json in {tok_dir} (run `specpilot zoo tokenizer` first)")
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    n_val = int(len(arr) * val_fraction) if len(arr) * val_fraction > 4 * (seq_len + 1) else 0
    if len(arr) - n_val < 2 * (seq_len + 1):
        raise SpecPilotError(f"only {len(arr)} tokens: too few for seq_len {seq_len}")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = make_config(preset, len(tok), eos, overrides)
    if int(arr.max()) >= cfg.vocab_size:
        raise SpecPilotError(f"token id {int(arr.max())} >= vocab size {cfg.vocab_size}: tokens and tokenizer do not match")
    model = Qwen3ForCausalLM(cfg).to(dev).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    data = torch.from_numpy(arr.astype(np.int64))
    train_data, val_data = (data[:-n_val], data[-n_val:]) if n_val else (data, None)
    train_data = train_data.to(dev)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    warmup = min(200, max(1, steps // 10)) if warmup is None else max(1, warmup)
    amp = dev.type == "cuda"
    fwd = torch.compile(model) if compile and amp else model
    gen = torch.Generator().manual_seed(seed)
    val_gen_seed = seed + 1

    def loss_of(x: torch.Tensor, m=fwd) -> torch.Tensor:
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = m(input_ids=x[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(n_batches: int = 10) -> float | None:
        if val_data is None:
            return None
        model.eval()
        g = torch.Generator().manual_seed(val_gen_seed)
        vals = [loss_of(_batch(val_data, batch_size, seq_len, g).to(dev), model).item() for _ in range(n_batches)]
        model.train()
        return float(np.mean(vals))

    losses: list[float] = []
    val_curve: list[tuple[int, float]] = []
    pending: list[torch.Tensor] = []
    stopped_early = False
    t_train = time.time()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cols = [TextColumn(f"[bold]{preset}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*cols, disable=quiet) as bar:
        task = bar.add_task("train", total=steps, loss="-")
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup)
            loss = loss_of(_batch(train_data, batch_size, seq_len, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            pending.append(loss.detach())
            last = step + 1 == steps
            eval_now = bool(eval_every) and ((step + 1) % eval_every == 0 or last)
            if len(pending) >= 25 or last or eval_now:  # fetch losses in groups: no host sync every step
                losses += torch.stack(pending).float().cpu().tolist()
                pending.clear()
                bar.update(task, completed=step + 1, loss=f"{np.mean(losses[-25:]):.3f}")
                if time_limit_s is not None and time.time() - t_train > time_limit_s and not last:
                    stopped_early = True
            if eval_now or (eval_every and stopped_early):
                v = evaluate()
                if v is not None:
                    val_curve.append((step + 1, v))
                    bar.console.log(f"step {step + 1}: train {np.mean(losses[-50:]):.3f}  held-out {v:.3f}")
            if stopped_early:
                break
    train_s = time.time() - t_train

    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu").to(torch.bfloat16).eval()
    model.config.eos_token_id = eos
    model.config.pad_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(outp))
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, outp / f.name)
    tail = losses[-50:]
    prov = {
        "recipe": "specpilot zoo",
        "command": command or " ".join(sys.argv),
        "preset": preset,
        "architecture": "Qwen3ForCausalLM",
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "head_dim", "num_key_value_heads", "intermediate_size",
                                                 "tie_word_embeddings", "max_position_embeddings")},
        "parameters": n_params,
        "saved_dtype": "bfloat16",
        "data": {
            "sources": ["Python standard library source (*.py)", "GSM8K train split (openai/grade-school-math, MIT)"],
            "excluded": "evaluation prompts (GSM8K test, HumanEval, MBPP, MT-Bench) are never used for training",
            "corpus": tok_meta.get("corpus", {}),
            "tokens_file_sha256": tok_meta.get("tokens_sha256"),
            "tokenizer_sha256": tok_meta.get("tokenizer_sha256"),
        },
        "tokens": int(len(arr)),
        "train_tokens": int(len(arr) - n_val),
        "heldout_tokens": int(n_val),
        "seed": seed,
        "steps": steps,
        "steps_done": len(losses),
        "stopped_early": stopped_early,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_seen": len(losses) * batch_size * seq_len,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "schedule": "linear warmup, cosine to 0.1 x lr",
        "optimizer": "AdamW(betas=(0.9, 0.95), grad clip 1.0)",
        "precision": "bf16 autocast" if amp else "float32",
        "initial_train_loss": float(np.mean(losses[:10])) if losses else None,
        "final_train_loss": float(np.mean(tail)) if tail else None,  # mean of the last 50 steps
        "final_heldout_loss": val_curve[-1][1] if val_curve else None,
        "heldout_curve": val_curve,
        "train_wall_s": round(train_s, 2),
        "wall_s": round(time.time() - t_start, 2),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": sys.version.split()[0],
        "git_commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (outp / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    plot_loss(losses, outp / "loss.png", f"{preset}: {n_params / 1e6:.2f}M params, {len(losses)} steps", val_curve)
    return prov

"""Block drafters for SmolLM2-135M-Instruct (or any converted target): one shared data cache, then
``train_drafter`` per kind.

Why a probe and not only ``specpilot train-drafter``: the training data (the target's greedy continuations of
training text and its features at the layers the drafter reads) is the costly part, and the CLI's feature pass
runs one sequence at a time. Here the features come from one pass over many sequences packed into one row set
with a block-diagonal causal mask (same layers, same positions, so the same features up to float rounding;
``--check`` compares a few against :func:`~specpilot.spec.train_block.target_features`). The cache is written in
the format ``train_drafter(data_cache=...)`` reads, so the training itself is the library's.

Data (§1.1, DFlash-style): snippets of ``--tokens`` (the target's tokenizer over ``specpilot zoo corpus``:
stdlib source + GSM8K train, never an evaluation prompt; the last 1% of the tokens is never used), each continued
greedily by the target for ``--gen-len`` tokens without an EOS stop. ``--chat-prompts`` mixes in chat turns (a
fraction ``--chat-fraction`` of the sequences): ``chat`` renders GSM8K **train** questions through the target's chat
template and keeps the last ``--prompt-len`` tokens of each (ending in the assistant header), so the drafter also sees
the target answering as an assistant, as it does on MT-Bench; the last 1% of the questions is never used.

Usage (from the repository root; a CUDA GPU makes it minutes, the CPU hours)::

    python probes/smollm2_drafters.py chat --target DIR --questions gsm8k_train.jsonl --prompt-len 64 --out Q.npy
    python probes/smollm2_drafters.py data --target DIR --tokens T.npy --cache C.pt --device cuda [--chat-prompts Q.npy]
    python probes/smollm2_drafters.py train --target DIR --tokens T.npy --cache C.pt --kind block --out OUT ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specpilot.model.checkpoint import load_model, read_args
from specpilot.spec.train_block import (default_target_layers, greedy_continuations, make_sequences, target_features,
                                        train_drafter)


@torch.no_grad()
def packed_features(target, seqs: torch.Tensor, layers: tuple[int, ...], rows: int = 2048) -> torch.Tensor:
    """``[N, T, len(layers) * hidden] float16``: :func:`target_features` computed ``rows // T`` sequences per
    pass (block-diagonal causal mask, positions restarting at 0 per sequence)."""
    n, t = seqs.shape
    k = max(1, rows // t)
    dev = target.device
    out = torch.empty(n, t, len(layers) * target.args.hidden_size, dtype=torch.float16)
    cache = target.new_cache(k * t)
    for i in range(0, n, k):
        m = min(k, n - i)
        pos = torch.arange(t, device=dev).repeat(m)
        seg = torch.arange(m, device=dev).repeat_interleave(t)
        mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        feats: list = []
        target.forward(seqs[i : i + m].reshape(-1).to(dev), pos, cache, 0, mask=mask, features=feats,
                       feature_layers=tuple(layers))
        out[i : i + m] = torch.cat(feats, -1).view(m, t, -1).to("cpu", torch.float16)
    return out


def cache_key(target_dir, n_seqs, prompt_len, gen_len, seed, layers) -> dict:
    """The key ``train_drafter`` checks before it reuses a data cache (same fields, same order)."""
    return dict(n_seqs=n_seqs, prompt_len=prompt_len, gen_len=gen_len, seed=seed, layers=list(layers),
                target=str(Path(target_dir).resolve()))


def chat_prompts(target_dir, questions_jsonl, prompt_len: int, held_out: float = 0.01):
    """``[n, prompt_len] int32``: the last ``prompt_len`` tokens of each question's chat rendering (user turn +
    assistant header), for the questions whose rendering is at least that long; the last ``held_out`` of the file's
    questions are left out."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    qs = [json.loads(line)["question"] for line in Path(questions_jsonl).read_text().splitlines() if line.strip()]
    qs = qs[: int(len(qs) * (1 - held_out))]
    rows = []
    for q in qs:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) >= prompt_len:
            rows.append(ids[-prompt_len:])
    return np.asarray(rows, dtype=np.int32)


def mixed_sequences(a) -> torch.Tensor:
    """``[n_seqs, prompt_len + gen_len] long``: corpus snippets, then (``--chat-prompts``) a ``--chat-fraction`` of
    chat prompts drawn with the seed, each continued greedily by the target."""
    import numpy as np

    n_chat = int(round(a.n_seqs * a.chat_fraction)) if a.chat_prompts else 0
    seqs = make_sequences(a.target, a.tokens, a.n_seqs - n_chat, a.prompt_len, a.gen_len, a.seed, batch=a.gen_batch,
                          device=a.device)
    if not n_chat:
        return seqs
    q = np.load(a.chat_prompts)
    if q.ndim != 2 or q.shape[1] != a.prompt_len:
        raise SystemExit(f"{a.chat_prompts}: shape {q.shape}, expected [n, {a.prompt_len}]")
    pick = np.random.default_rng(a.seed + 7).integers(0, len(q), n_chat)
    chat = greedy_continuations(a.target, torch.from_numpy(q[pick].astype(np.int64)), a.gen_len, batch=a.gen_batch,
                                device=a.device)
    return torch.cat([seqs, chat])[torch.randperm(a.n_seqs, generator=torch.Generator().manual_seed(a.seed))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("chat", "data", "train"))
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokens")
    ap.add_argument("--cache")
    ap.add_argument("--questions", help="chat: GSM8K train JSONL")
    ap.add_argument("--chat-prompts", default=None, help="data: .npy of chat prompts from the chat stage")
    ap.add_argument("--chat-fraction", type=float, default=0.25)
    ap.add_argument("--n-seqs", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--target-layers", default=None, help="comma-separated; default (1, L/2, L-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--check", type=int, default=4, help="data: sequences compared with the one-by-one features")
    ap.add_argument("--seqs-out", default=None, help="data: also save the sequences (int32 .pt)")
    ap.add_argument("--kind", default="block")
    ap.add_argument("--out", default=None)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--max-seconds", type=float, default=None, help="train: wall-time budget of the optimizer loop")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=None, help="train: eagle3's draft vocabulary (most frequent ids)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="train: eagle3's training-time-test steps")
    a = ap.parse_args(argv)
    if a.stage == "chat":
        import numpy as np

        q = chat_prompts(a.target, a.questions, a.prompt_len)
        np.save(a.out, q)
        print(json.dumps({"stage": "chat", "prompts": list(q.shape), "out": a.out}))
        return
    nl = read_args(a.target).num_layers
    layers = default_target_layers(nl) if a.target_layers is None else tuple(int(x) for x in a.target_layers.split(","))
    key = cache_key(a.target, a.n_seqs, a.prompt_len, a.gen_len, a.seed, layers)
    if a.stage == "data":
        t0 = time.time()
        seqs = mixed_sequences(a)
        t1 = time.time()
        target = load_model(a.target, "float32", a.device).requires_grad_(False)
        feats = packed_features(target, seqs, layers)
        t2 = time.time()
        ref = target_features(target, seqs[: a.check], list(layers)).float()
        err = (ref - feats[: a.check].float()).abs().max().item() / ref.abs().max().item()
        Path(a.cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "seqs": seqs, "feats": feats}, a.cache)
        if a.seqs_out:
            torch.save({"key": key, "seqs": seqs.to(torch.int32)}, a.seqs_out)
        print(json.dumps({"stage": "data", "seqs": list(seqs.shape), "generate_s": round(t1 - t0, 1),
                          "features_s": round(t2 - t1, 1), "save_s": round(time.time() - t2, 1),
                          "packed_vs_one_by_one_max_rel_err": err, "layers": list(layers)}), flush=True)
        return
    cmd = "python " + " ".join(sys.argv)
    prov = train_drafter(a.target, a.out, kind=a.kind, block=a.block, steps=a.steps, batch_size=a.batch_size,
                         anchors=a.anchors, lr=a.lr, n_seqs=a.n_seqs, prompt_len=a.prompt_len, gen_len=a.gen_len,
                         layers=a.layers, target_layers=layers, seed=a.seed, tokens_path=a.tokens, device=a.device,
                         command=cmd, quiet=True, data_cache=a.cache, max_seconds=a.max_seconds,
                         draft_vocab_size=a.draft_vocab, ttt_steps=a.ttt_steps)
    print(json.dumps({k: prov[k] for k in ("kind", "parameters", "initial_heldout_loss", "final_heldout_loss",
                                           "final_heldout_top1_acc_pos0", "training")}), flush=True)


if __name__ == "__main__":
    main()

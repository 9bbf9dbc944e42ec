"""Training a block drafter (DFlash / DSpark style, §1.1) on the target's own greedy continuations.

Data: random snippets of the training tokens (``tokens.npy`` of the zoo recipe: stdlib source + GSM8K train,
never evaluation prompts), each continued greedily by the target for ``gen_len`` tokens (batched
``transformers`` generation, no EOS stop). Target features (outputs of ``target_layers``) come from our own
:class:`~specpilot.model.transformer.Transformer`, i.e. exactly what the engine hands the drafter. Each example
picks ``anchors`` random anchor positions inside the continuation; the drafter sees the context before the
anchor, the anchor token, and predicts the target's next B tokens (cross-entropy per block position, weight
exp(−i/7) for position i as in DFlash; the Markov drafter adds the loss of the parent-conditioned logits).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.model.checkpoint import load_model
from specpilot.errors import SpecPilotError
from specpilot.spec.block import save_block
from specpilot.spec.block_net import BlockConfig, BlockNet


def make_sequences(target_dir, tokens_path, n_seqs: int, prompt_len: int, gen_len: int, seed: int,
                   batch: int = 256, device: str = "cpu", val_fraction: float = 0.01, quiet: bool = False) -> torch.Tensor:
    """``[n_seqs, prompt_len + gen_len] long``: training-text snippets + the target's greedy continuation.

    Snippets start at random offsets of the first ``1 - val_fraction`` of ``tokens_path`` (the zoo's
    held-out tail is never used). ``quiet``: no transformers progress bar while it loads the target
    (:func:`hf_progress_bars`). Raises SpecPilotError when the token file is missing, not a 1-D integer .npy
    array, too short, or holds ids outside the target's vocabulary.
    """
    p = Path(tokens_path)
    if not p.is_file():
        raise SpecPilotError(f"token file not found: {p} (run `specpilot zoo corpus` / `zoo tokenize` first)")
    try:
        arr = np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise SpecPilotError(f"cannot read token file {p}: not a .npy array of token ids (make one with `specpilot zoo "
                             f"tokenize`; numpy: {str(e).splitlines()[0][:60]})") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise SpecPilotError(f"token file {p} must hold a 1-D integer array of token ids, got "
                             f"{getattr(arr, 'ndim', '?')}-D {getattr(arr, 'dtype', type(arr).__name__)}")
    from specpilot.model.checkpoint import read_args

    vocab = read_args(target_dir).vocab_size
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
        raise SpecPilotError(f"token file {p} holds ids outside the target's vocabulary [0, {vocab})")
    usable = int(len(arr) * (1 - val_fraction)) - prompt_len - 1
    if usable < 1:
        raise SpecPilotError(f"token file {p} holds {len(arr)} tokens: too few for {prompt_len}-token snippets")
    g = np.random.default_rng(seed)
    starts = g.integers(0, usable, n_seqs)
    prompts = torch.from_numpy(np.stack([arr[s : s + prompt_len] for s in starts]).astype(np.int64))
    return greedy_continuations(target_dir, prompts, gen_len, batch=batch, device=device, quiet=quiet)


def greedy_continuations(target_dir, prompts: torch.Tensor, gen_len: int, batch: int = 256, device: str = "cpu",
                         quiet: bool = False) -> torch.Tensor:
    """``[N, P + gen_len] long``: each row of ``prompts`` (``[N, P]`` integer token ids) followed by the target's
    greedy continuation of ``gen_len`` tokens (transformers' batched ``generate``, float32, no EOS stop, so every
    row has the same length). ``quiet``: no "Loading weights" bar (:func:`hf_progress_bars`)."""
    from transformers import AutoModelForCausalLM

    with hf_progress_bars(not quiet):
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # continue past EOS: every row gets gen_len greedy tokens
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            x = prompts[i : i + batch].to(device, torch.long)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
            out.append(y.cpu())
    return torch.cat(out)


@contextmanager
def hf_progress_bars(show: bool):
    """transformers' progress bars (its "Loading weights" bar) shown or not for the enclosed calls only: its switch
    is process-wide, so the state it had is restored on exit."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was != show:
        (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        if was != show:
            (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


@torch.no_grad()
def target_features(target, seqs: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """``[N, T, len(layers) * hidden] float16``: outputs of ``layers`` of our target over each sequence."""
    n, t = seqs.shape
    cache = target.new_cache(t)
    out = torch.empty(n, t, len(layers) * target.args.hidden_size, dtype=torch.float16)
    for i in range(n):
        feats: list = []
        target.forward(seqs[i].to(target.device), torch.arange(t, device=target.device), cache, 0,
                       features=feats, feature_layers=tuple(layers))
        out[i] = torch.cat(feats, -1).to("cpu", torch.float16)
    return out


def block_loss(net: BlockNet, target, seqs, feats, anchors) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of a batch and the top-1 accuracy of position 0.

    Args:
        seqs: ``[Bt, T] long``; feats: ``[Bt, T, F]``; anchors: ``[Bt, M] long`` anchor positions with
            ``anchor + B < T`` (targets are ``seqs[anchor + 1 … anchor + B]``).
    Returns:
        (scalar loss in nats, weighted over block positions; accuracy of the first position in [0, 1]).
    """
    b = net.cfg.block_size
    bt, t = seqs.shape
    m = anchors.shape[1]
    dev = seqs.device
    ctx = net.context_kv(feats.to(torch.float32), torch.arange(t, device=dev).expand(bt, t))
    x = net.block_input(seqs.gather(1, anchors).reshape(-1), target.model.embed_tokens, b).view(bt, m * b, -1)
    pos = (anchors[..., None] + torch.arange(b, device=dev)).view(bt, m * b)
    tgt, prev = seqs.gather(1, pos + 1), seqs.gather(1, pos)
    ctx_mask = torch.arange(t, device=dev)[None, None, :] < anchors.repeat_interleave(b, 1)[..., None]
    r = torch.arange(m * b, device=dev)
    blk = (r[:, None] // b == r[None, :] // b) & (r[None, :] <= r[:, None])
    mask = torch.cat((ctx_mask, blk.expand(bt, -1, -1)), -1)
    logits = target.lm_head(net.run(x, pos, ctx, mask)).float()  # [Bt, M*B, V]
    w = torch.exp(-torch.arange(b, device=dev, dtype=torch.float32) / 7.0).repeat(m)
    w = w / w.sum()

    def ce(lg):
        return (F.cross_entropy(lg.transpose(1, 2), tgt, reduction="none").mean(0) * w).sum()

    loss = ce(logits)
    if net.cfg.markov_rank > 0:
        cond = logits + net.markov_bias(prev)
        loss = loss + ce(cond)
        logits = cond
    acc = (logits.view(bt, m, b, -1)[:, :, 0].argmax(-1) == tgt.view(bt, m, b)[:, :, 0]).float().mean()
    return loss, acc


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a drafter reads by default: a low, a middle and a high one, ``(1, L // 2, L - 1)`` for
    a target of ``L`` decoder layers (EAGLE-3's low/mid/high fusion; ``(1, 3, 5)`` for the bundled 6-layer
    target, ``(1, 15, 29)`` for SmolLM2's 30). Fewer layers: each once. Raises ValueError for L < 1."""
    if num_layers < 1:
        raise ValueError(f"a target has at least one layer, got {num_layers}")
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


def train_drafter(target_dir, out, kind: str = "block", block: int = 16, steps: int = 600, batch_size: int = 16,
                  anchors: int = 4, lr: float = 2e-3, n_seqs: int = 1536, prompt_len: int = 32, gen_len: int = 80,
                  markov_rank: int = 16, layers: int = 2, target_layers=None, seed: int = 0,
                  tokens_path="work/zoo/tokens.npy", device: str = "cpu", command: str = "",
                  quiet: bool = False, data_cache: str | Path | None = None, draft_vocab_size: int | None = None,
                  ttt_steps: int = 4, max_seconds: float | None = None) -> dict:
    """Train a ``block``, ``block_markov`` or ``eagle3`` drafter for the target in ``target_dir``; write it to ``out``.

    ``target_layers``: the 0-based target layers whose outputs the drafter reads (None:
    :func:`default_target_layers` of the target's depth). Writes ``config.json``, ``model.safetensors`` (bf16),
    ``provenance.json`` and ``loss.png``.
    ``data_cache`` (a ``.pt`` path) keeps generated sequences + features for a second run (e.g. the other
    kind). ``eagle3`` (:mod:`specpilot.spec.train_eagle3`): ``draft_vocab_size`` ids (None: min(vocab, 32000), as
    EAGLE-3 for Llama 3), ``ttt_steps`` training-time-test steps; ``block`` / ``anchors`` / ``markov_rank`` /
    ``layers`` are block options. Returns the provenance dict. Raises SpecPilotError on a bad kind / block / draft
    vocabulary / missing token file.
    ``max_seconds`` bounds the optimizer loop's wall time: after 10 timed steps the run is re-planned to the steps
    that fit (at most ``steps``), and the learning-rate schedule follows the new length, so a run on a lent machine
    ends with its warm-down instead of being killed; the provenance records planned and run steps.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from specpilot.provenance import git_commit, versions
    from specpilot.zoo.train import lr_at, plot_loss

    if kind not in ("block", "block_markov", "eagle3"):
        raise SpecPilotError(f"unknown drafter kind {kind!r} (choose block, block_markov or eagle3)")
    if kind == "eagle3" and ttt_steps < 1:
        raise SpecPilotError(f"--ttt-steps must be at least 1, got {ttt_steps}")
    if kind != "eagle3" and not 2 <= block <= 32:
        raise SpecPilotError(f"block size must be in [2, 32], got {block}")
    torch.manual_seed(seed)
    t0 = time.time()
    target = load_model(target_dir, "float32", device).requires_grad_(False)
    ta = target.args
    target_layers = default_target_layers(ta.num_layers) if target_layers is None else tuple(target_layers)
    if not target_layers or max(target_layers) >= ta.num_layers or min(target_layers) < 0:
        raise SpecPilotError(f"target has {ta.num_layers} layers (0-{ta.num_layers - 1}); cannot read layers "
                             f"{list(target_layers)}")
    dv = min(ta.vocab_size, 32000) if draft_vocab_size is None else draft_vocab_size
    if not 1 <= dv <= ta.vocab_size:
        raise SpecPilotError(f"--draft-vocab must be in [1, {ta.vocab_size}] (the target's vocabulary), got {dv}")
    cp = Path(data_cache) if data_cache else None
    key = dict(n_seqs=n_seqs, prompt_len=prompt_len, gen_len=gen_len, seed=seed, layers=list(target_layers),
               target=str(Path(target_dir).resolve()))
    # mmap: a cache of tens of GB (the features) pages in as batches read it, instead of loading whole first
    d = torch.load(cp, mmap=True) if cp is not None and cp.is_file() else None
    if d is not None and d["key"] == key:
        seqs, feats = d["seqs"], d["feats"]
    else:
        seqs = make_sequences(target_dir, tokens_path, n_seqs, prompt_len, gen_len, seed, device=device, quiet=quiet)
        feats = target_features(target, seqs, list(target_layers))
        if cp is not None:
            cp.parent.mkdir(parents=True, exist_ok=True)
            tmp = cp.with_name(cp.name + ".tmp")  # a new file, renamed over: a mapped older cache stays intact
            torch.save({"key": key, "seqs": seqs, "feats": feats}, tmp)
            tmp.replace(cp)
    data_s = time.time() - t0
    n_val = max(1, len(seqs) // 20)
    tr_s, tr_f, va_s, va_f = seqs[:-n_val], feats[:-n_val], seqs[-n_val:], feats[-n_val:]
    t_len = seqs.shape[1]
    if kind == "eagle3":
        from specpilot.spec.eagle3 import save_eagle3
        from specpilot.spec.train_eagle3 import draft_vocab, eagle3_loss, new_eagle3_net

        net = new_eagle3_net(ta, target_layers, draft_vocab(tr_s, dv, ta.vocab_size, prompt_len)).to(device).train()
        hi = t_len

        def loss_of(s, f, a):
            return eagle3_loss(net, target, s, f, prompt_len, ttt_steps)
    else:
        net, hi = _block_net(kind, block, markov_rank, layers, target_layers, ta, device), t_len - block
        if t_len - block - 1 < prompt_len - 1:
            raise SpecPilotError(f"gen_len {gen_len} too short for block {block}")
        if draft_vocab_size is not None:  # trained over the whole vocabulary, drafting over the most frequent ids
            if dv < 16:
                raise SpecPilotError(f"--draft-vocab for a block drafter must be at least 16 (its candidates per "
                                     f"position), got {dv}")
            from specpilot.spec.train_eagle3 import draft_vocab

            net = with_draft_vocab(net, draft_vocab(tr_s, dv, ta.vocab_size, prompt_len))

        def loss_of(s, f, a):
            return block_loss(net, target, s, f, a)
    n_params = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def batch(s, f, n, gen):
        idx = torch.randint(0, len(s), (n,), generator=gen)
        a = torch.randint(prompt_len - 1, hi, (n, anchors), generator=gen)
        return s[idx].to(device), f[idx].to(device), a.to(device)

    @torch.no_grad()
    def evaluate():
        net.eval()
        gv = torch.Generator().manual_seed(seed + 1)
        vals = [loss_of(*batch(va_s, va_f, batch_size, gv)) for _ in range(4)]
        net.train()
        return float(np.mean([v[0].item() for v in vals])), float(np.mean([v[1].item() for v in vals]))

    losses, val_curve = [], []
    v0 = evaluate()
    val_curve.append((0, v0[0]))
    label = f"eagle3 V={net.cfg.draft_vocab_size}" if kind == "eagle3" else f"{kind} B={block}"
    cols = [TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    t1, planned, step = time.time(), steps, 0
    with Progress(*cols, disable=quiet) as bar:
        task = bar.add_task("train", total=steps, loss="-")
        while step < steps:
            if max_seconds is not None and step == 10:  # re-plan to the time budget (docstring)
                per_step = (time.time() - t1) / 10
                steps = max(11, min(planned, int(max_seconds / per_step)))
                bar.update(task, total=steps)
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
            loss, _ = loss_of(*batch(tr_s, tr_f, batch_size, g))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.update(task, completed=step + 1, loss=f"{np.mean(losses[-20:]):.3f}")
            if (step + 1) % max(1, steps // 5) == 0 or step + 1 == steps:
                val_curve.append((step + 1, evaluate()[0]))
            step += 1
    train_s = time.time() - t1
    vf = evaluate()
    outp = save_eagle3(net.eval(), out) if kind == "eagle3" else save_block(net.eval(), out)
    shared = ("embed_tokens is the target's (not stored); the LM head is the drafter's own, over the draft vocabulary"
              if kind == "eagle3" else "embed_tokens and lm_head are the target's (not stored)")
    prov = {
        "recipe": "specpilot train-drafter", "command": command, "kind": kind,
        "block_size": None if kind == "eagle3" else block,
        "seed": seed, "steps": steps,
        "parameters": n_params, "saved_dtype": "bfloat16", "shared_with_target": shared,
        "target": {"dir": str(target_dir), "hidden_size": ta.hidden_size, "vocab_size": ta.vocab_size,
                   "num_layers": ta.num_layers, "target_layers": list(target_layers)},
        "data": {"source": str(tokens_path), "sequences": n_seqs, "prompt_len": prompt_len, "gen_len": gen_len,
                 "continuations": "the target's own greedy continuations (no EOS stop)",
                 "excluded": "evaluation prompts (GSM8K test, HumanEval, MBPP, MT-Bench) and the tokens' "
                             "held-out tail are never used", "heldout_sequences": n_val},
        "training": {"steps": steps, "planned_steps": planned, "max_seconds": max_seconds, "batch_size": batch_size,
                     "anchors_per_sequence": anchors, "lr": lr,
                     "seed": seed, "device": device, "data_s": round(data_s, 1), "train_s": round(train_s, 1)},
        "initial_heldout_loss": v0[0], "final_train_loss": float(np.mean(losses[-20:])),
        "final_heldout_loss": vf[0], "final_heldout_top1_acc_pos0": vf[1], "heldout_curve": val_curve,
        "git_commit": git_commit(), "versions": versions(),
    }
    if kind == "eagle3":
        prov["eagle3"] = {"draft_vocab_size": net.cfg.draft_vocab_size, "ttt_steps": ttt_steps,
                          "draft_vocab": "the most frequent target ids among the training split's greedy tokens",
                          "top1_acc": "step 0 of the training-time test (the first draft position)"}
    (outp / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    plot_loss(losses, outp / "loss.png", f"{label}: {n_params / 1e6:.2f}M params, {steps} steps", val_curve)
    return prov


def with_draft_vocab(net: BlockNet, ids: torch.Tensor) -> BlockNet:
    """``net`` (its weights shared) drafting over the target ids ``ids [n] long`` only
    (:attr:`BlockConfig.draft_vocab_size`); the loss trains the whole vocabulary's head either way, so the
    restriction only renormalizes the drafter's scores over the ids kept."""
    cfg = replace(net.cfg, draft_vocab_size=len(ids))
    with torch.device("meta"):
        out = BlockNet(cfg)
    out.load_state_dict({**net.state_dict(keep_vars=True), "draft_ids": ids.to(net.fc.weight.device)}, assign=True)
    return out.train(net.training)


def _block_net(kind, block, markov_rank, layers, target_layers, ta, device) -> BlockNet:
    """A fresh block drafter network for a target of ``ta`` (ModelArgs), on ``device``, in training mode."""
    cfg = BlockConfig(block_size=block, markov_rank=markov_rank if kind == "block_markov" else 0, layers=layers,
                      heads=ta.n_heads, kv_heads=ta.n_kv_heads, head_dim=ta.head_dim,
                      intermediate_size=2 * ta.hidden_size, target_layers=list(target_layers),
                      target_hidden=ta.hidden_size, vocab_size=ta.vocab_size, target_num_layers=ta.num_layers,
                      target_model_type=ta.model_type, rms_norm_eps=ta.rms_norm_eps, rope_theta=ta.rope_theta)
    return BlockNet(cfg).to(device).train()

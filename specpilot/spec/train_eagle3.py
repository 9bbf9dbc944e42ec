"""Training an EAGLE-3 drafter (§1.1; Li et al., EAGLE-3) on the target's own greedy continuations: its draft
vocabulary, its network sized from the target, and the loss with EAGLE-3's *training-time test*.

The data are those of :mod:`specpilot.spec.train_block` (training-text snippets continued greedily by the target, the
target's features of every position); :func:`specpilot.spec.train_block.train_drafter` runs the loop for every kind.

Training-time test: step 0 runs every row ``j`` of a sequence (token ``j + 1``, target feature ``j``, position ``j``)
causally, as drafting from committed positions does; step ``s ≥ 1`` runs row ``j`` again one position further
(token ``j + 1 + s``, the drafter's *own* pre-norm hidden of step ``s - 1`` at row ``j``, position ``j + s``), attending
to step 0's rows up to ``j`` and to its own rows of steps ``1 … s`` (the keys a draft path of depth ``s + 1`` sees at
inference). Step ``s`` predicts the token at ``j + 2 + s``. The label is the target's greedy token mapped into the
draft vocabulary; rows whose label is not the target's greedy output (inside the prompt snippet), lies past the
sequence, or is outside the draft vocabulary carry no loss. Step ``s`` weighs ``0.8 ** s`` (EAGLE-3's weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.spec.eagle3_net import Eagle3Config, Eagle3Net

STEP_DECAY = 0.8  # weight of training-time-test step s: 0.8 ** s


def draft_vocab(seqs: torch.Tensor, size: int, vocab_size: int, prompt_len: int) -> torch.Tensor:
    """The draft vocabulary: ``[size] long`` target ids, ascending, the ``size`` most frequent among the target's
    greedy tokens ``seqs[:, prompt_len:]`` (ties: the lower id); ids never seen fill up to ``size`` (lowest first).

    Raises:
        ValueError: ``size`` outside ``[1, vocab_size]``.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} outside [1, {vocab_size}]")
    counts = torch.bincount(seqs[:, prompt_len:].reshape(-1).cpu(), minlength=vocab_size).double()
    order = torch.argsort(-counts + torch.arange(vocab_size) / (2.0 * vocab_size))  # count desc, then id asc
    return order[:size].sort().values


def new_eagle3_net(target_args, target_layers, draft_ids: torch.Tensor) -> Eagle3Net:
    """A fresh :class:`Eagle3Net` for a target of ``target_args`` (one decoder layer of the target's shape, the
    target's embedding shared) reading ``target_layers``, with the draft vocabulary ``draft_ids`` ([Vd] long)."""
    a = target_args
    cfg = Eagle3Config(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, heads=a.n_heads,
                       kv_heads=a.n_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
                       draft_vocab_size=len(draft_ids), target_hidden=a.hidden_size, target_layers=list(target_layers),
                       rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                       target_num_layers=a.num_layers, target_model_type=a.model_type)
    net = Eagle3Net(cfg)
    for m in net.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    net.set_vocab(draft_ids)
    return net


def ttt_logits(net: Eagle3Net, target, seqs: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits of every training-time-test step: ``steps`` tensors ``[Bt, T, draft_vocab_size] float32``; step
    ``s`` row ``j`` predicts the token at ``j + 2 + s`` (rows past the sequence read clamped tokens: mask them).

    Args:
        seqs: ``[Bt, T] long`` token ids; feats: ``[Bt, T, F]`` target features (any float dtype).
    """
    bt, t = seqs.shape
    dev = seqs.device
    j = torch.arange(t, device=dev)
    hid = net.fuse(feats.to(net.fc.weight.dtype))
    keys, vals, out = [], [], []
    causal = j[None, :] <= j[:, None]
    diag = torch.eye(t, dtype=torch.bool, device=dev)
    for s in range(steps):
        toks = seqs[:, (j + 1 + s).clamp(max=t - 1)]
        q, k, v, res = net.project(net.embed(toks, target.model.embed_tokens), hid, (j + s).expand(bt, t))
        keys.append(k)
        vals.append(v)
        mask = torch.cat([causal] + [diag] * s, dim=1).expand(bt, -1, -1)
        hid = net.finish(net.attend(q, torch.cat(keys, 1), torch.cat(vals, 1), mask), res)
        out.append(net.draft_logits(hid))
    return out


def eagle3_loss(net: Eagle3Net, target, seqs: torch.Tensor, feats: torch.Tensor, prompt_len: int,
                steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of a batch with the training-time test (:func:`ttt_logits`), and the step-0 top-1 accuracy.

    Args:
        seqs: ``[Bt, T] long`` snippet + greedy continuation; feats: ``[Bt, T, F]`` target features (any float).
        prompt_len: snippet length (labels before it are training text, not the target's greedy tokens).
        steps: training-time-test steps (≥ 1).
    Returns:
        (scalar loss in nats, the ``0.8 ** s``-weighted mean over steps; step 0's accuracy in [0, 1] over rows with a
        loss).
    """
    t = seqs.shape[1]
    j = torch.arange(t, device=seqs.device)
    pos_of_draft = torch.cumsum(net.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    total = torch.zeros((), device=seqs.device)
    acc = torch.zeros((), device=seqs.device)
    for s, logits in enumerate(ttt_logits(net, target, seqs, feats, steps)):
        lab_pos = j + 2 + s
        labels = seqs[:, lab_pos.clamp(max=t - 1)]
        keep = ((lab_pos < t) & (lab_pos >= prompt_len))[None] & net.t2d[labels]  # [Bt, T]
        tgt = pos_of_draft[labels].clamp(min=0)
        ce = F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
        n = keep.sum().clamp(min=1)
        total = total + STEP_DECAY ** s * (ce * keep).sum() / n
        if s == 0:
            acc = ((logits.argmax(-1) == tgt) & keep).sum() / n
    return total / sum(STEP_DECAY ** s for s in range(steps)), acc

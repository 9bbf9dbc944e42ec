"""Helpers for the block-drafter tests: tiny block drafters, trained briefly on a tiny target's greedy outputs."""

from __future__ import annotations

import functools

import torch

from specpilot.config import SystemConfig
from specpilot.spec.block import BlockConfig, BlockNet
from specpilot.spec.train_block import block_loss, target_features
from specpilot.spec.train_eagle3 import draft_vocab, eagle3_loss, new_eagle3_net
from specpilot.engine.engine import Engine

from .conftest import random_prompts


def tiny_config(target, block=6, markov_rank=0) -> BlockConfig:
    a = target.args
    return BlockConfig(block_size=block, markov_rank=markov_rank, layers=1, heads=a.n_heads, kv_heads=a.n_kv_heads,
                       head_dim=a.head_dim, intermediate_size=2 * a.hidden_size, target_layers=[0, a.num_layers - 1],
                       target_hidden=a.hidden_size, vocab_size=a.vocab_size, target_num_layers=a.num_layers)


def greedy_data(target, n=24, prompt_len=12, gen=40, seed=5):
    """``[n, prompt_len + gen]`` prompts + the target's AR greedy continuation (no EOS)."""
    eng = Engine(target, SystemConfig.ar(), None, eos_ids=[])
    rows = [p + eng.generate(p, gen).tokens for p in random_prompts(n, target.args.vocab_size, prompt_len, seed)]
    return torch.tensor(rows)


def train_tiny(target, cfg: BlockConfig, steps=120, seed=0, prompt_len=12, lr=1e-2, seqs=None):
    """Train a tiny block drafter on ``seqs`` (default: :func:`greedy_data`); returns ``(net, losses)`` (loss per
    step, nats)."""
    torch.manual_seed(seed)
    seqs = greedy_data(target, prompt_len=prompt_len) if seqs is None else seqs
    feats = target_features(target, seqs, cfg.target_layers)
    net = BlockNet(cfg).train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    t = seqs.shape[1]
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(seqs), (8,), generator=g)
        a = torch.randint(prompt_len - 1, t - cfg.block_size, (8, 4), generator=g)
        loss, _ = block_loss(net, target, seqs[idx], feats[idx], a)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.eval().requires_grad_(False), losses


@functools.lru_cache(maxsize=None)
def trained_pair(target):
    """``{"block": (net, losses), "block_markov": (net, losses)}`` for ``target`` (cached per session)."""
    target.requires_grad_(False)
    return {"block": train_tiny(target, tiny_config(target, markov_rank=0), steps=200),
            "block_markov": train_tiny(target, tiny_config(target, markov_rank=8), steps=200)}


def train_eagle3_tiny(target, layers, seqs, draft_size, steps=150, prompt_len=12, seed=0):
    """Train a tiny eagle3 drafter reading target ``layers`` on ``seqs`` (:func:`greedy_data`), draft vocabulary the
    ``draft_size`` most frequent ids; returns ``(net, losses, feats)``."""
    feats = target_features(target, seqs, list(layers))
    torch.manual_seed(seed)
    net = new_eagle3_net(target.args, layers, draft_vocab(seqs, draft_size, target.args.vocab_size, prompt_len))
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(seqs), (8,), generator=g)
        loss, _ = eagle3_loss(net, target, seqs[idx], feats[idx], prompt_len, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.eval().requires_grad_(False), losses, feats

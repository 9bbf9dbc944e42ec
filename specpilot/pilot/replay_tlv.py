"""Exact replay of TLV (§4.3): tokens per exact pass of two-level verification from recorded lattices and Q passes.

Along an AR output, the exact pass's argmax is the output itself (see :mod:`.replay`). What a TLV cycle adds is
the Q pass's argmax, so this module records, at every committed length m, the Q pass of the Q view over the chain
of AR tokens from that step's root (the exact prefix in the cache, the chain's rows through the Q view, as the
engine's Q pass sees a tree path): ``q[m][j]`` is its argmax at the chain's row j, the Q pass's guess for
``ar[m + j]``. A cycle then replays as the engine runs it:

1. draft ① is the recorded lattice at m, shaped by the configured builder;
2. the Q walk steps from the root to the child equal to the Q argmax while the Q argmax equals the AR token
   (rows on the AR path are the recorded chain's rows);
3. if the Q argmax leaves the AR path after j tokens, the chain C is wrong at its token j: the exact pass accepts
   the j tokens before it plus its own bonus, whatever draft ② hung under C;
4. otherwise C = the walk's j tokens + the Q bonus (the AR token), all right; draft ② is the recorded lattice at
   m + |C| with N − |C| nodes, and the exact pass accepts C, the subtree's matching path and the bonus.

Two things replay cannot see: a chain that leaves the AR path has an off-path tail and subtree whose size is not
recorded, so its exact pass is counted at the full ``1 + N`` rows (an upper bound on its cost); and a drafter that
reads target features drafts ② from the exact pass's features here, from the Q pass's features live. Tokens per
exact pass are exact otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specpilot.config import SystemConfig
from specpilot.model.cache import PassKind
from specpilot.pilot.replay import Recording, TruncatedLattice, _accepted
from specpilot.spec.trees import build_tree


@dataclass
class QRecording:
    """The Q pass's argmax along AR outputs.

    Attributes:
        chains: per request, ``{m: [q_0, ..., q_L]}``: at committed length m (output tokens), the Q argmax at each
            row of the AR chain ``ar[m-1 : m+L]`` run from root ``ar[m-1]`` (``q_j`` guesses ``ar[m + j]``).
        depth: chain rows recorded past the root (the most draft positions a replay may use).
        weights: the Q view's weights (``view8`` / ``int8`` / ``int6``).
    """

    chains: list[dict[int, list[int]]] = field(default_factory=list)
    depth: int = 0
    weights: str = "view8"

    def agreement(self, rec: Recording) -> dict:
        """How often the Q pass's argmax equals the exact one (§4.3: 98.7% of positions in the paper):
        ``{"root": fraction at each step's root row, "rows": fraction over every recorded chain row, "positions"}``."""
        root = rows = n_root = n_rows = 0
        for ar, chains in zip(rec.ar, self.chains):
            for m, q in chains.items():
                hits = [int(t == ar[m + j]) for j, t in enumerate(q) if m + j < len(ar)]
                root, n_root = root + hits[0], n_root + 1
                rows, n_rows = rows + sum(hits), n_rows + len(hits)
        return {"root": root / max(n_root, 1), "rows": rows / max(n_rows, 1), "positions": n_root}


@torch.inference_mode()
def record_q(target, q_target, rec: Recording, depth: int, weights: str = "view8") -> QRecording:
    """Q passes along every AR output of ``rec`` (module docstring): for each request one exact prefill of prompt +
    output into a fresh cache, then at every committed length m one ``INSPECT`` pass of ``q_target`` over the AR
    chain from the root (at most ``depth + 1`` rows). ``target`` / ``q_target``: the target and its Q view
    (:func:`specpilot.model.qview.q_view`)."""
    out = QRecording(depth=depth, weights=weights)
    dev = target.device
    for prompt, ar in zip(rec.prompts, rec.ar):
        seq = prompt + ar
        cache = target.new_cache(len(seq) + depth + 1)
        target.forward(torch.tensor(seq[:-1], device=dev), torch.arange(len(seq) - 1, device=dev), cache, 0)
        cache.commit(len(seq) - 1)
        chains = {}
        for m in range(1, len(ar)):
            start = len(prompt) + m - 1  # the root ar[m - 1] sits at this slot
            rows = seq[start : start + depth + 1]
            hidden = q_target.forward(torch.tensor(rows, device=dev), torch.arange(start, start + len(rows), device=dev),
                                      cache, start, _causal(start, len(rows), dev), kind=PassKind.INSPECT)
            chains[m] = q_target.greedy(hidden).tolist()
        out.chains.append(chains)
    return out


def _causal(start: int, r: int, dev) -> torch.Tensor:
    """``[r, start + r] bool``: every row sees the prefix, itself and the rows before it."""
    mask = torch.ones(r, start + r, dtype=torch.bool, device=dev)
    mask[:, start:] = torch.ones(r, r, dtype=torch.bool, device=dev).tril()
    return mask


def replay_tlv_steps(rec: Recording, qrec: QRecording, config: SystemConfig) -> list[tuple[int, int, int, int]]:
    """TLV cycles of ``config`` (its builder, N, depth, K; ``tlv`` itself need not be set) replayed on ``rec`` and
    ``qrec``: ``[(tokens kept, exact-pass rows, Q-pass rows, |C|)]``, one per exact pass; a step whose draft ① is
    empty runs no Q pass (0 Q rows) and verifies the root alone, as the engine does.

    Raises:
        ValueError: ``config`` asks for more depth or candidates than were recorded.
    """
    if config.depth > min(rec.depth, qrec.depth) or config.top_k > rec.top_k:
        raise ValueError(f"recorded depth {min(rec.depth, qrec.depth)} / top-K {rec.top_k} cannot replay "
                         f"{config.label()}")
    n, out = config.nodes, []
    for ar, lats, chains in zip(rec.ar, rec.lattices, qrec.chains):
        m = 1
        while m < len(ar):
            remaining = len(ar) - m
            lat = lats.get(m) if remaining > 1 else None
            first = build_tree(config.tree, TruncatedLattice(lat, min(config.depth, remaining - 1), config.top_k),
                               n) if lat is not None else None
            if first is None or not len(first):
                out.append((1, 1, 0, 0))
                m += 1
                continue
            kept, rows, c = _cycle(first, chains[m], ar, m, lats, config)
            kept = min(kept, remaining)
            out.append((kept, rows, 1 + len(first), c))
            m += kept
    return out


def _cycle(first, q: list[int], ar: list[int], m: int, lats: dict, config: SystemConfig) -> tuple[int, int, int]:
    """One cycle from committed length m: ``(tokens the exact pass accepts incl. its bonus, its rows, |C|)``."""
    n, remaining = config.nodes, len(ar) - m
    cap = min(n, remaining - 1)  # the engine cuts C to this many tokens
    kids, row, j = first.child_maps(), 0, 0
    while j < len(q) and m + j < len(ar) and q[j] == ar[m + j] and q[j] in kids[row]:
        row, j = kids[row][q[j]], j + 1
    right = j < len(q) and m + j < len(ar) and q[j] == ar[m + j]  # the Q bonus is the AR token
    if not right and j < cap:  # C is wrong at its token j: the exact pass keeps j tokens and its own bonus
        return j + 1, 1 + n, j + 1
    c = min(j + 1, cap)  # C = the walk + the Q bonus, every token right
    a2, rows2 = 0, 1
    m2 = m + c
    if n > c and remaining - c > 1 and lats.get(m2) is not None:
        lat2 = TruncatedLattice(lats[m2], min(config.depth, remaining - c - 1), config.top_k)
        a2, rows2 = _accepted(lat2, ar[m2:], config.model_copy(update={"nodes": n - c}), None, None)
    return c + a2 + 1, c + rows2, c


def replay_tlv(rec: Recording, qrec: QRecording, config: SystemConfig) -> dict:
    """Summary of :func:`replay_tlv_steps`: ``{tau, steps, exact_rows, q_rows, chain}`` (means per exact pass; τ
    counts tokens per exact pass, §4.3)."""
    steps = replay_tlv_steps(rec, qrec, config)
    k = max(len(steps), 1)
    return {"tau": sum(s[0] for s in steps) / k, "steps": len(steps), "exact_rows": sum(s[1] for s in steps) / k,
            "q_rows": sum(s[2] for s in steps) / k, "chain": sum(s[3] for s in steps) / k}


__all__ = ["QRecording", "record_q", "replay_tlv_steps", "replay_tlv"]

"""Block drafter (DFlash-style parallel drafting, §1.1) with an optional Markov head (DSpark-style): a
:class:`~specpilot.spec.block_net.BlockNet` bound to a target, holding many requests in slots and drafting a batch
of them in one pass of the network; and its checkpoints.

Checkpoint: a directory with ``config.json`` (``"specpilot_drafter": "block"`` + :class:`BlockConfig`
fields + the target facts it was trained for) and ``model.safetensors``; or a public DFlash drafter's directory,
loaded in place by :mod:`specpilot.spec.dflash_import`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from specpilot.errors import DrafterError
from specpilot.model.transformer import Transformer
from specpilot.spec.block_net import BlockConfig, BlockNet
from specpilot.spec.dflash_import import is_dflash_dir, load_dflash
from specpilot.spec.block_batch_step import BatchBlockStep
from specpilot.spec.block_step import StaticBlockStep
from specpilot.spec.drafter import DraftRequest
from specpilot.spec.lattice import MarkovLattice, PositionalLattice

TOP_K = 16  # candidates per position kept in a block drafter's lattice (§1.1)


class BlockDrafter:
    """Block drafter bound to a target (:class:`~specpilot.spec.drafter.Drafter`): holds the context K/V of up to
    ``max_slots`` requests and drafts every request of a batch in one pass of its network.

    Args:
        net: a :class:`BlockNet` (same dtype / device as the target).
        target: the target :class:`Transformer` (its embedding and LM head are shared).
        top_k: candidates per position exposed by the lattice (≤ 16).
        max_len: context slots (positions) allocated per request slot up front; the buffers grow (doubling, for
            every slot at once) when a longer context is observed.
        max_slots: requests held at once (slots ``[0, max_slots)``; 1: the single-request engine's slot 0).
        static_step: run slot 0's single-request steps (the observation staged by :meth:`observe`, then the
            draft) as one static pass, a CUDA graph on CUDA (:class:`~specpilot.spec.block_step.StaticBlockStep`);
            batches of several requests stay eager.
        compile_step: compile that static pass with ``torch.compile`` before capturing it (CUDA; see
            :class:`~specpilot.spec.block_step.StaticBlockStep`).
        batch_step: run every batch's observations and draft as one static pass per (requests, width) bucket, CUDA
            graphs on CUDA (:class:`~specpilot.spec.block_batch_step.BatchBlockStep`; no Markov head); the buffers
            then hold one scratch slot more.
    Raises:
        ValueError: ``max_slots < 1``; ``batch_step`` with a Markov head.

    State per slot ``s``: the context K/V of that request's committed positions ``[0, context_length(s))`` in
    :attr:`slot_k` / :attr:`slot_v` ``[max_slots, layers, S, kv_heads, head_dim]`` (the target's dtype and
    device; ``S`` ≥ ``max_len``), written by :meth:`observe`, forgotten by :meth:`reset`. The engine captures the
    target's outputs at :attr:`target_layers` and hands them to :meth:`observe`. The drafter always runs all B
    block rows and cuts each lattice to its depth, so a lattice's first positions do not depend on the requested
    depth (exact replay), and a request's lattice does not depend on the batch it is drafted in (up to float
    rounding of the batched kernels).
    """

    kind = "block"
    max_context: int | None = None

    def __init__(self, net: BlockNet, target: Transformer, top_k: int = TOP_K, max_len: int = 4096,
                 max_slots: int = 1, static_step: bool = False, compile_step: bool = False, batch_step: bool = False):
        if max_slots < 1:
            raise ValueError(f"a block drafter holds at least one request, max_slots {max_slots} given")
        self.net, self.target, self.top_k = net.eval(), target, min(top_k, TOP_K)
        self.cfg = net.cfg
        self.target_layers = tuple(net.cfg.target_layers)
        self.vocab_size = net.cfg.vocab_size
        self.max_slots = max_slots
        shape = (max_slots + batch_step, net.cfg.layers, max(max_len, 1), net.cfg.kv_heads, net.cfg.head_dim)
        self.slot_k = torch.zeros(shape, dtype=target.dtype, device=target.device)
        self.slot_v = torch.zeros(shape, dtype=target.dtype, device=target.device)
        self._lengths = [0] * max_slots  # per slot: committed positions whose context K/V are held (or staged)
        #: the draft vocabulary's target ids ``[Vd] long`` and the shared head's rows of them ``[Vd, hidden]`` (None:
        #: the whole vocabulary, through the target's own head)
        self.draft_ids = net.draft_ids if net.cfg.draft_vocab_size > 0 else None
        self.head_w = target.head_rows(self.draft_ids) if self.draft_ids is not None else None
        self._step = StaticBlockStep(self, compile=compile_step) if static_step else None
        if self._step is not None:
            self._step.capture_all()  # every context width's graph now (CUDA), not inside a timed request
        self._batch = BatchBlockStep(self) if batch_step else None
        if self._batch is not None:
            self._batch.capture_all()

    @property
    def ctx_k(self) -> torch.Tensor:
        """Slot 0's context keys ``[layers, S, kv_heads, head_dim]`` (a view; the single-request layout)."""
        return self.slot_k[0]

    @property
    def ctx_v(self) -> torch.Tensor:
        """Slot 0's context values ``[layers, S, kv_heads, head_dim]`` (a view)."""
        return self.slot_v[0]

    def check_slot(self, slot: int) -> None:
        """Raise :class:`DrafterError` unless ``0 <= slot < max_slots``."""
        if not 0 <= slot < self.max_slots:
            raise DrafterError(f"the {self.kind} drafter holds {self.max_slots} request(s) (slots 0 to "
                               f"{self.max_slots - 1}), asked for slot {slot}")

    def context_length(self, slot: int = 0) -> int:
        """Committed positions of ``slot``'s request whose context K/V are held (set by :meth:`observe`, 0 after
        :meth:`reset`)."""
        self.check_slot(slot)
        return self._lengths[slot]

    def reset(self, slot: int = 0) -> None:
        """Forget the request held in ``slot`` (a new request starts there)."""
        self.check_slot(slot)
        self._lengths[slot] = 0
        if slot == 0 and self._step is not None:
            self._step.flush()  # the staged observation belonged to the request forgotten here
        if self._batch is not None:
            self._batch.take(slot)

    def _flush(self) -> None:
        """Write slot 0's staged observation (:class:`StaticBlockStep`) eagerly, before an eager read or write."""
        staged = self._step.flush() if self._step is not None else None
        if staged is not None:
            self._write(0, *staged)
        for slot in list(self._batch.pending) if self._batch is not None else ():
            self._write(slot, *self._batch.take(slot))

    def _reserve(self, n: int) -> None:
        """Context buffers of at least ``n`` positions per slot (doubling; every slot's held positions kept)."""
        have = self.slot_k.shape[2]
        if n <= have:
            return
        size = max(n, 2 * have)
        for name in ("slot_k", "slot_v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], size, *old.shape[3:]))
            new[:, :, :have] = old
            setattr(self, name, new)

    @torch.inference_mode()
    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Store the context K/V of ``slot``'s committed positions ``[start, start + k)`` from the target features
        ``features [k, len(target_layers) * hidden]`` (any float dtype; cast to the target's); the slot's context
        then ends there (positions past it are forgotten). With :attr:`static_step`, slot 0's observation of at
        most B + 1 positions is staged and written by the next draft's static pass."""
        self.check_slot(slot)
        if self._batch is not None:  # staged for the slot's next batched draft (an older one written first)
            if not self._batch.stage(slot, features, start):
                if (older := self._batch.take(slot)) is not None:
                    self._write(slot, *older)
                if not self._batch.stage(slot, features, start):
                    self._write(slot, features, start)
                    return
            self._lengths[slot] = start + features.shape[0]
            return
        self._flush()
        if slot == 0 and self._step is not None:
            self._reserve(start + self._step.pad_rows)  # the static pass writes its padding rows past the end
            if self._step.stage(features, start):
                self._lengths[0] = start + features.shape[0]
                return
        self._write(slot, features, start)

    def _write(self, slot: int, features: torch.Tensor, start: int) -> None:
        """The context K/V of ``features [k, F]`` to ``slot``'s positions ``[start, start + k)``, eagerly."""
        k = features.shape[0]
        self._reserve(start + k)
        pos = torch.arange(start, start + k, device=features.device)
        for i, (ck, cv) in enumerate(self.net.context_kv(features.to(self.slot_k.dtype), pos)):
            self.slot_k[slot, i, start : start + k] = ck
            self.slot_v[slot, i, start : start + k] = cv
        self._lengths[slot] = start + k

    def _contexts(self, slots: list[int], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer, (keys, values) ``[Bt, width, kv_heads, head_dim]`` of the first ``width`` context
        positions of ``slots`` (a view when the slots are consecutive and ascending, else a gathered copy)."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            k = self.slot_k[slots[0] : slots[0] + len(slots), :, :width]
            v = self.slot_v[slots[0] : slots[0] + len(slots), :, :width]
        else:
            idx = torch.tensor(slots, device=self.slot_k.device)
            k, v = self.slot_k[idx, :, :width], self.slot_v[idx, :, :width]
        return [(k[:, i], v[:, i]) for i in range(self.cfg.layers)]

    @torch.inference_mode()
    def batch_logits(self, slots: list[int], committed: list[list[int]]) -> torch.Tensor:
        """Base logits ``[Bt, B, vocab] float32`` of the B block positions after each ``committed[b]``, drafted
        from the context of ``slots[b]`` (distinct slots, each holding ``len(committed[b]) - 1`` positions; not
        checked here), in one pass of the network.

        The block rows ``[Bt, B, hidden]`` sit at positions ``n_b - 1 … n_b + B - 2`` (``n_b = len(committed[b])``).
        Each row's keys are its request's context padded to the longest, ``[Bt, C, ...]`` with
        ``C = max_b (n_b - 1)``, then the block rows; the mask ``[Bt, B, C + B] bool`` lets a row attend to its own
        request's context positions ``[0, n_b - 1)`` and causally to its block's rows (never to the padding).
        """
        self._flush()
        b, dev = self.cfg.block_size, self.slot_k.device
        lengths = torch.tensor([len(c) - 1 for c in committed], device=dev)  # [Bt] context positions
        width = max(len(c) - 1 for c in committed)
        anchors = torch.tensor([c[-1] for c in committed], device=dev)
        x = self.net.block_input(anchors, self.target.model.embed_tokens, b)  # [Bt, B, hidden]
        pos = lengths[:, None] + torch.arange(b, device=dev)  # [Bt, B]
        mask = torch.empty(len(committed), b, width + b, dtype=torch.bool, device=dev)
        mask[:, :, :width] = (torch.arange(width, device=dev) < lengths[:, None])[:, None, :]
        mask[:, :, width:] = torch.ones(b, b, dtype=torch.bool, device=dev).tril()
        h = self.net.run(x, pos, self._contexts(slots, width), mask)
        return self.draft_logits(h.reshape(-1, h.shape[-1])).view(len(committed), b, -1)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, Vd] float32`` of drafter rows ``h [R, hidden]`` over the draft vocabulary (the target's whole
        vocabulary, ``Vd = vocab_size``, without one): the shared LM head (§1.1)."""
        if self.head_w is None:
            return self.target.logits(h)
        return torch.nn.functional.linear(h, self.head_w).float()

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-16 of ``logits [..., Vd] float32``: ``(target ids, log-probs normalized over the draft vocabulary,
        draft-vocabulary indices)``, each ``[..., 16]``, best first."""
        vals, idx = logits.topk(TOP_K, dim=-1)
        logp = vals - logits.logsumexp(-1, keepdim=True)
        return (idx if self.draft_ids is None else self.draft_ids[idx]), logp, idx

    def markov_cond(self, logits: torch.Tensor, parents: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The Markov head's parent-conditioned log-probs ``[D, parent 16, child 16] float32``: position ``d``'s
        logits ``logits [D, Vd]`` plus the bias of each parent token ``parents [D, 16]`` (target ids), renormalized
        over the draft vocabulary, at the children ``idx [D, 16]`` (draft-vocabulary indices)."""
        bias = self.net.markov_u(parents)
        w = self.net.markov_v.weight if self.draft_ids is None else self.net.markov_v.weight[self.draft_ids]
        cond = (logits[:, None, :] + torch.nn.functional.linear(bias, w).float()).log_softmax(-1)  # [D, 16, Vd]
        return cond.gather(-1, idx[:, None, :].expand(-1, TOP_K, -1))

    def block_logits(self, committed: list[int], slot: int = 0) -> torch.Tensor:
        """Base logits ``[B, vocab] float32`` of the B block positions after ``committed`` (one request)."""
        self._check_context(slot, committed)
        return self.batch_logits([slot], [committed])[0]

    def _check_context(self, slot: int, committed: list[int]) -> None:
        self.check_slot(slot)
        if self._lengths[slot] != len(committed) - 1:
            raise RuntimeError(f"block drafter context of slot {slot} holds {self._lengths[slot]} positions, "
                               f"expected {len(committed) - 1}")

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftRequest]) -> list[PositionalLattice | MarkovLattice | None]:
        """Per request, ``min(depth, B)`` positions drafted after its committed tokens, the requests with depth ≥ 1
        drafted together in one pass (:meth:`batch_logits`): a :class:`PositionalLattice` ``[depth, top_k]`` (no
        Markov head) or a :class:`MarkovLattice` (top-16 base candidates per position, parent-conditioned
        log-probs renormalized exactly over the full vocabulary); None for a request with depth < 1. Each lattice
        is the one that request would get drafted alone. Needs each slot's context of ``committed[:-1]`` (R11).

        Raises:
            DrafterError: a slot outside ``[0, max_slots)``, or one slot twice in the batch.
            RuntimeError: a drafted request whose slot's context does not end at ``len(committed) - 1``.
        """
        out: list[PositionalLattice | MarkovLattice | None] = [None] * len(batch)
        seen: set[int] = set()
        for q in batch:
            self.check_slot(q.slot)
            if q.slot in seen:
                raise DrafterError(f"the {self.kind} drafter was asked about slot {q.slot} twice in one batch")
            seen.add(q.slot)
        drafted = [(i, q, min(q.depth, self.cfg.block_size)) for i, q in enumerate(batch) if q.depth >= 1]
        if not drafted:
            return out
        for _, q, _ in drafted:
            self._check_context(q.slot, q.committed)
        if self._step is not None and len(drafted) == 1 and drafted[0][1].slot == 0:
            i, q, d = drafted[0]
            out[i] = self._static_lattice(q.committed, d)
            return out
        if self._batch is not None:
            return self._batch_lattices(drafted, out)
        logits = self.batch_logits([q.slot for _, q, _ in drafted], [q.committed for _, q, _ in drafted])
        toks, marg, idx = self.candidates(logits)  # [Bt, B, 16] each
        if self.cfg.markov_rank == 0:
            toks, marg = toks[..., : self.top_k].cpu(), marg[..., : self.top_k].cpu()
            for j, (i, _, d) in enumerate(drafted):
                out[i] = PositionalLattice(toks[j, :d], marg[j, :d])
            return out
        toks_c, marg_c = toks.cpu(), marg.cpu()
        for j, (i, q, d) in enumerate(drafted):  # per request: [d, 16, vocab] floats at a time
            anchor = torch.tensor([q.committed[-1]], device=logits.device)
            parents = torch.cat((anchor.expand(1, TOP_K), toks[j, : d - 1]), 0)  # [d, 16]; row 0: the anchor
            cond = self.markov_cond(logits[j, :d], parents, idx[j, :d])  # [d, parent j, child c]
            out[i] = MarkovLattice(toks_c[j, :d], marg_c[j, :d], cond.cpu(), q.committed[-1], self.top_k)
        return out


    def _batch_lattices(self, drafted: list, out: list) -> list:
        """``out`` with each drafted request's lattice from the batched static pass (staged observations first)."""
        pend = self._batch.pending
        self._reserve(max(pend[q.slot][0] if q.slot in pend else len(q.committed) - 1 for _, q, _ in drafted)
                      + self._batch.pad_rows)
        o = self._batch.run([(q.slot, q.committed[-1], len(q.committed) - 1) for _, q, _ in drafted])
        for j, (i, _, d) in enumerate(drafted):
            out[i] = PositionalLattice(o["toks"][j, :d, : self.top_k].clone(), o["marg"][j, :d, : self.top_k].clone())
        return out

    def _static_lattice(self, committed: list[int], d: int) -> PositionalLattice | MarkovLattice:
        """Slot 0's lattice of ``d`` positions through the static pass (the staged observation written first)."""
        length = len(committed) - 1
        start = self._step.pending[0] if self._step.pending is not None else length
        self._reserve(start + self._step.pad_rows)
        o = self._step.run(committed[-1], length)
        if self.cfg.markov_rank == 0:
            return PositionalLattice(o["toks"][:d, : self.top_k].clone(), o["marg"][:d, : self.top_k].clone())
        return MarkovLattice(o["toks"][:d].clone(), o["marg"][:d].clone(), o["cond"][:d].clone(), committed[-1],
                             self.top_k)


def save_block(net: BlockNet, out: str | Path, extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (bf16) of ``net`` to ``out``; returns the directory."""
    from specpilot.fileio import save_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"specpilot_drafter": "block", "kind": net.cfg.kind, **asdict(net.cfg), **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
          for k, v in net.state_dict().items()}  # weights in bf16; the draft vocabulary's ids stay ids
    save_safetensors(sd, out / "model.safetensors")
    return out


def is_block_dir(path) -> bool:
    """True when ``path/config.json`` declares ``"specpilot_drafter": "block"`` or is a public DFlash drafter's."""
    p = Path(path) / "config.json"
    try:
        if p.is_file() and json.loads(p.read_text()).get("specpilot_drafter") == "block":
            return True
    except (OSError, ValueError):
        return False
    return is_dflash_dir(path)


def load_block(path, target: Transformer) -> BlockNet:
    """Load a block drafter directory for ``target`` (dtype / device of the target).

    Raises:
        DrafterError: missing files, or the drafter does not fit the target (hidden size, vocabulary,
            layer indices); a DFlash directory's errors as :func:`~specpilot.spec.dflash_import.load_dflash`.
    """
    from specpilot.fileio import load_safetensors

    p = Path(path)
    if is_dflash_dir(p):
        return load_dflash(p, target)
    if not is_block_dir(p) or not (p / "model.safetensors").is_file():
        raise DrafterError(f"{p} is not a block drafter directory (a config.json with \"specpilot_drafter\": \"block\" "
                           "and a model.safetensors; a causal LM directory is a draft model)")
    raw = json.loads((p / "config.json").read_text())
    names = BlockConfig.__dataclass_fields__
    cfg = BlockConfig(**{k: v for k, v in raw.items() if k in names})
    ta = target.args
    if cfg.target_hidden != ta.hidden_size or cfg.vocab_size != ta.vocab_size:
        raise DrafterError(f"block drafter {p} was built for hidden {cfg.target_hidden} / vocab {cfg.vocab_size}, "
                           f"the target has hidden {ta.hidden_size} / vocab {ta.vocab_size}")
    if 0 < cfg.draft_vocab_size < TOP_K or cfg.draft_vocab_size > ta.vocab_size:
        raise DrafterError(f"block drafter {p} drafts over {cfg.draft_vocab_size} ids: a draft vocabulary holds "
                           f"{TOP_K} to {ta.vocab_size} ids (0: the whole vocabulary)")
    if max(cfg.target_layers) >= ta.num_layers or min(cfg.target_layers) < 0:
        raise DrafterError(f"block drafter {p} reads target layers {cfg.target_layers}, "
                           f"the target has {ta.num_layers} layers")
    with torch.device("meta"):  # no initialisation (the weights are loaded next; it would draw from torch's RNG)
        net = BlockNet(cfg)
    net = net.to_empty(device="cpu")
    try:
        net.load_state_dict(load_safetensors(p / "model.safetensors", DrafterError))
    except RuntimeError as e:
        raise DrafterError(f"block drafter weights in {p} do not match its config.json: {str(e)[:200]}") from None
    return net.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)

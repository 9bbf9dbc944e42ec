"""Rows of several requests in one exact pass: which request each row belongs to, its cache slot, what it sees.

A batched pass packs every request's rows (``[root] + tree`` in a decode step, the prompt in a prefill) into one
``[R]`` sequence, so projections and MLPs run as single GEMMs over all rows (§2.2: in batching every row costs,
and one weight stream serves them all). Attention is per request: request ``b``'s rows attend to its own
committed slots ``[0, start_b)`` of its pool slot and, among its own rows, to what its mask allows (ancestors for
a tree, earlier rows for a prompt). :meth:`~specpilot.model.layers.Attention.forward_batch` is the plain PyTorch
reference: the rows padded to ``[B, R_max]``, every request's keys gathered to ``[B, S]``, one masked SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch



@dataclass
class BatchRows:
    """The requests of one batched pass.

    Attributes:
        slots: pool slot of each request (``B`` ints, distinct).
        starts: committed slots of each request: its rows' K/V go to ``[start, start + count)`` of its slot.
        counts: rows of each request (≥ 1); the pass's rows are request 0's, then request 1's, ...
        masks: per request the ``[count, count]`` bool mask among its rows (True = may attend; a tree's
            ancestor-or-self mask), or None for causal rows (a prompt, a chain).
    """

    slots: list[int]
    starts: list[int]
    counts: list[int]
    masks: list[torch.Tensor | None]
    _prepared: dict = field(default_factory=dict, repr=False)

    def prepared(self, device) -> "Prepared":
        """The index tensors and the attention mask of this batch on ``device`` (built once per pass)."""
        key = str(device)
        if key not in self._prepared:
            self._prepared[key] = Prepared.of(self, torch.device(device))
        return self._prepared[key]


@dataclass
class Prepared:
    """Index tensors of a :class:`BatchRows` on a device.

    Attributes:
        req, j: ``[R] long``: each row's request and its index among that request's rows.
        slot, pos: ``[R] long``: the pool slot and position its K/V are written to.
        slots: ``[B] long``; span: the longest ``start + count`` (keys gathered per request); r_max: most rows.
        mask: ``[B, r_max, span] bool``: what each (padded) row of each request may attend to; a padding row sees
            position 0 only.
        starts, counts, row_off: ``[B] int32`` (with ``slots``, the batched kernel's per-request arguments);
        words: ``[B, r_max, ceil(r_max / 32)] int32``, each request's mask among its rows, bit-packed.
        window: the masked SDPA's layout (:func:`~specpilot.model.layers.batch_sdpa`). ``(lo, W)``: the requests'
            slots lie in ``[lo, lo + W)`` with ``W <= 2 B``, so the keys are that slice of the pool, a view (nothing
            gathered), and request ``i`` sits at batch index ``slot_i - lo``, the ``W - B`` slots between them
            padding (one key, outputs dropped). None: the keys are gathered per request, request ``i`` at index ``i``.
        flat: ``[R] long``, each row's place among the SDPA's padded ``[W * r_max]`` (or ``[B * r_max]``) rows (None:
            not built, as in the padded runner's pass); dense: that place is the row's own (padding is a reshape).
    """

    req: torch.Tensor
    j: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    span: int
    r_max: int
    mask: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    row_off: torch.Tensor
    words: torch.Tensor
    flat: torch.Tensor | None = None
    dense: bool = False
    window: tuple[int, int] | None = None
    _grouped: dict = field(default_factory=dict, repr=False)

    def sdpa_mask(self) -> torch.Tensor:
        """``[W, r_max, span] bool`` (``[B, ...]`` without a :attr:`window`): :attr:`mask` at each request's batch
        index of the SDPA's layout; a slot between the requests sees position 0 only."""
        if self.window is None:
            return self.mask
        lo, w = self.window
        place = self.slots - lo
        m = torch.zeros(w, *self.mask.shape[1:], dtype=torch.bool, device=self.mask.device)
        m[:, :, 0] = True
        m[place] = self.mask
        return m

    def grouped_mask(self, g: int) -> torch.Tensor:
        """``[W, 1, g * r_max, span]`` bool: :meth:`sdpa_mask` with each padded row repeated for the ``g`` query heads
        of a KV head (the layout of :func:`~specpilot.model.layers.grouped_sdpa`), built once per pass rather than
        once per layer, contiguous (the compiled decode attention is warmed for that layout)."""
        if g not in self._grouped:
            m = self.sdpa_mask()
            b, r, s = m.shape
            self._grouped[g] = m[:, None, None].expand(b, 1, g, r, s).reshape(b, 1, g * r, s).contiguous()
        return self._grouped[g]

    @classmethod
    def of(cls, rows: BatchRows, device: torch.device) -> "Prepared":
        b = len(rows.counts)
        if not b or len(rows.slots) != b or len(rows.starts) != b or len(rows.masks) != b or min(rows.counts) < 1:
            raise ValueError("a batch needs one slot, start, count (>= 1) and mask per request")
        req = torch.repeat_interleave(torch.arange(b), torch.tensor(rows.counts))
        j = torch.cat([torch.arange(c) for c in rows.counts])
        starts = torch.tensor(rows.starts)
        span = max(s + c for s, c in zip(rows.starts, rows.counts))
        r_max = max(rows.counts)
        mask = torch.zeros(b, r_max, span, dtype=torch.bool)
        mask[:, :, 0] = True  # padding rows: one harmless key (their outputs are dropped)
        for i, (s, c, m) in enumerate(zip(rows.starts, rows.counts, rows.masks)):
            mask[i, :c, :s] = True
            mask[i, :c, s:s + c] = torch.ones(c, c, dtype=torch.bool).tril() if m is None else m.cpu()
        own = torch.zeros(b, r_max, r_max, dtype=torch.bool)  # each request's mask among its rows, padded
        for i, (s, c) in enumerate(zip(rows.starts, rows.counts)):
            own[i, :c, :c] = mask[i, :c, s:s + c]
        counts = torch.tensor(rows.counts)
        i32 = {"dtype": torch.int32, "device": device}
        from specpilot.kernels.batch_attention import pack_batch_masks

        slots = torch.tensor(rows.slots)
        lo, w = min(rows.slots), max(rows.slots) + 1 - min(rows.slots)
        window = (lo, w) if w <= 2 * b else None  # a view, with at most as many padding slots as requests
        place = slots - lo if window is not None else torch.arange(b)
        dense = min(rows.counts) == r_max and bool((place == torch.arange(b)).all())
        return cls(req.to(device), j.to(device), slots[req].to(device), (starts[req] + j).to(device), slots.to(device),
                   span, r_max, mask.to(device), starts.to(**i32), counts.to(**i32),
                   (counts.cumsum(0) - counts).to(**i32), pack_batch_masks(own).to(device),
                   (place[req] * r_max + j).to(device), dense, window)

"""The certified head's first pass on the CPU: approximate logits from a oneDNN-prepacked bfloat16 copy of the head
(§4.1, the same certificate as the INT8 first pass, another approximant).

Why. The first pass exists to read fewer bytes than the exact head. On the CPU the INT8 reference converts the int8
weights to float32 on every call (slower than the exact head), ``aten._weight_int8pack_mm`` ran 105 ms at 8 rows of
SmolLM2's 49152 x 576 head against 4.9 ms for the prepacked float32 head, while a prepacked bf16 copy (AVX512-BF16
dot products) ran 2.5 / 2.8 / 5.3 ms at 1 / 8 / 32 rows against 4.9 / 4.9 / 10.3 (2 threads; the probe
``probes/cpu_head_first_pass.py``). bf16 keeps 8 significant bits against int8's 7 with a per-row scale, so its
bound is also tighter: 1.5 survivors a row on SmolLM2's hidden states of real text.

Bound. ``Wb = bf16(W)``, ``hb = bf16(h)`` (round to nearest). oneDNN multiplies them exactly into float32 (8 x 8
significant bits), sums in float32 in any order and rounds the sum ``s`` to bf16: ``a = bf16(s)``. Then, for row r
and vocab row v, with ``z = <W_v, h_r>`` in real arithmetic and ``zhat`` the exact head's float32 logit:

* ``|a - s| <= 2^-8 |a|`` (round to nearest with bf16's unit roundoff ``2^-8``: ``a = s / (1 + d)``, ``|d| <= 2^-8``;
  reached at ``s = 1 + 2^-8``, ``a = 1``);
* ``|s - <Wb_v, hb_r>| <= gamma_K(2^-24) ||Wb_v|| ||hb_r||`` (any order; Cauchy–Schwarz);
* ``|<Wb_v, hb_r> - z| <= ||Wb_v - W_v|| ||hb_r|| + ||W_v|| ||hb_r - h_r||``;
* ``|zhat - z| <= eps_x ||W_v|| ||h_r||`` (the exact head's own rounding, :func:`~specpilot.head.bound.eps`);
* flushed denormals (AVX512-BF16 reads denormal inputs as zero; products and partial sums under ``2^-126``): at
  most ``2^-126 (sqrt(K) (||hb_r|| + ||W_v||) + K)``: ``2^-120 sqrt(K)`` in ``c_v`` (times ``||hb_r||``) and in
  ``y_r`` (times ``||W_v||``), and the floor ``2^-100``.

So ``|zhat - a| <= E = 2^-8 |a| + ||hb_r|| c_v + y_r ||W_v||`` with ``c_v = ||Wb_v - W_v|| + gamma_K ||Wb_v||``
(float64, at build) and ``y_r = ||hb_r - h_r|| + eps_x ||h_r||``, evaluated in float64 and
inflated past its own roundings. Only a threshold test touches all of ``[R, V]`` (:meth:`Bf16FirstPass.survivors`):
a full evaluation of ``E`` there, ten passes over the logits, cost as much as the bf16 GEMM saved.
"""

from __future__ import annotations

import math

import torch

from specpilot.head.bound import eps, gamma
from specpilot.kernels.cpu_linear import packing_available

#: the bound's factor of ``|a|`` (module docstring: the bf16 rounding of the sum) and its absolute floor
_REL_A, _FLOOR = 2.0**-8, 2.0**-100
#: columns per block of the candidate search (:meth:`Bf16FirstPass.survivors`)
BLOCK = 64


#: the fewest head weights (V x K) for which the pilots propose the bf16 pass: it saves half the float32 head's read
#: (at ~20 GB/s on this 2-core CPU, 2^24 weights: 3.4 ms read, ~1.7 saved) and costs ~0.5-1 ms of small ops a call;
#: on the bundled 4096 x 256 head it ran 0.91-0.99x AR in a pilot, on SmolLM2's 49152 x 576 head 0.6-0.85x a call
MIN_HEAD_WEIGHTS = 1 << 24


def worth(weight: torch.Tensor) -> bool:
    """Whether the pilots propose the bf16 pass for a head of ``weight``: :func:`applies`, and at least
    :data:`MIN_HEAD_WEIGHTS` weights."""
    return applies(weight) and weight.numel() >= MIN_HEAD_WEIGHTS


def applies(weight: torch.Tensor) -> bool:
    """Whether the bf16 first pass can serve a head of ``weight``: float32 on the CPU, a build that prepacks for
    oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and packing_available()


def _block_max(a: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 -> ``[R, ceil(V / BLOCK)]``: each block of :data:`BLOCK` columns' maximum (NaN propagates)."""
    r, v = a.shape
    full = v // BLOCK * BLOCK
    out = [a[:, :full].view(r, -1, BLOCK).amax(dim=2)] if full else []
    if full < v:
        out.append(a[:, full:].amax(dim=1, keepdim=True))
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def _tiny(k: int) -> float:
    """``2^-120 sqrt(K)``: more than the ``2^-126 sqrt(K)`` a norm's worth of flushed denormal inputs can move a
    K-term dot product, per unit of the other factor's norm (module docstring)."""
    return 2.0**-120 * math.sqrt(k)


def _row_terms(h: torch.Tensor, eps_x: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` float64 ``[R]`` of ``h [R, K]``: ``x = ||hb||``, ``y = ||h - hb|| + eps_x ||h||`` (module doc)."""
    h64, hb64 = h.double(), h.bfloat16().double()
    n = torch.stack((hb64, h64 - hb64, h64)).norm(dim=2)
    return n[0], n[1] + eps_x * n[2] + _tiny(h.shape[1])  # + the flushed denormal inputs of h, times ||W_v||


class Bf16FirstPass:
    """Approximate logits and their certified error for :class:`~specpilot.head.certified.CertifiedInt8Head` on the
    CPU (module docstring).

    Args:
        weight: the head ``W [V, K]`` float32 on the CPU (read once; the pass keeps a packed bf16 copy, half its
            bytes, and ``2 x V`` float64 coefficients).
        w_norm: ``||W_v||`` float64 ``[V]`` (the head's own).
    Raises:
        ValueError: a weight :func:`applies` rejects.
    """

    def __init__(self, weight: torch.Tensor, w_norm: torch.Tensor):
        if not applies(weight):
            raise ValueError(f"the bf16 first pass takes a float32 CPU head with oneDNN packing, got {weight.dtype} "
                             f"on {weight.device}")
        v, k = weight.shape
        self.k = k
        wb = weight.detach().bfloat16()
        self._pack = torch.ops.mkldnn._reorder_linear_weight(wb, None)
        c = torch.empty(v, dtype=torch.float64)
        g, tiny = gamma(k, 2.0**-24), _tiny(k)
        step = max(1, (1 << 22) // max(k, 1))
        for r0 in range(0, v, step):
            w64, wb64 = weight[r0:r0 + step].double(), wb[r0:r0 + step].double()
            c[r0:r0 + step] = (w64 - wb64).norm(dim=1) + g * wb64.norm(dim=1) + tiny
        self.coef = torch.stack([c, w_norm])  # [2, V] float64: multiplies ||hb_r|| and y_r
        self.cmax, self.wmax = (float(m) for m in self.coef.max(dim=1).values)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``a [R, V]`` bfloat16: the bf16 copy's logits of ``bf16(h)`` for ``h [R, K]`` float32."""
        return torch.ops.mkldnn._linear_pointwise(h.bfloat16(), self._pack, None, "none", [], "")

    def survivors(self, h: torch.Tensor, eps_x: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The vocab rows whose interval ``[a - E, a + E]`` (module docstring) reaches the row's highest lower end,
        which hold the exact head's argmax (and every tie of it) for finite ``h [R, K]`` float32 without overflow (the
        caller checks those); ``eps_x``: the exact head's relative rounding factor.

        Returns ``(cols [S] long, keep [R, S] bool)``: the union of the rows' survivors, ascending, and which row
        keeps which. A row with a NaN or +inf logit keeps nothing (a -inf logit is dropped alone; such rows
        overflow, and the caller's overflow check sends them to the full head).

        Two passes over the ``[R, V]`` logits (widened to float32, and each block of :data:`BLOCK` columns' maximum),
        then float64 on the few candidates: with ``E_v <= rho |a_v| + B_r`` (``rho`` the bound's factor of ``|a|``,
        ``B_r`` from the largest coefficients), a survivor needs ``a_v + rho |a_v| >= L* - B_r``, ``L*`` a lower
        bound of the lower end at the row's largest ``a`` (at most the highest lower end): a threshold on ``a_v``
        alone, tested on the blocks whose maximum reaches it. The row's highest lower end is a candidate's, so it is
        found among them. (On this 2-core CPU a boolean pass over ``[8, 49152]`` took 120-200 µs and a bf16 argmax
        740, against 46 for both passes here.)
        """
        a = self.logits(h).float()  # exact widening: float32 reductions run at ~10x bf16's speed here
        r, v = a.shape
        x, y = (t.tolist() for t in _row_terms(h, eps_x))
        blocks = _block_max(a)  # [R, ceil(V / BLOCK)]
        thr = []  # per row, in Python floats (IEEE double, as torch's float64): R is a few dozen at most
        rel = _REL_A * (1 + 2.0**-40)  # E's factor of |a|, as bound() below inflates it
        for top, xr, yr in zip(blocks.amax(dim=1).tolist(), x, y):
            b_max = (xr * self.cmax + yr * self.wmax + _FLOOR) * (1 + 2.0**-40)  # E_v <= rel |a_v| + b_max
            t = top - (rel * abs(top) + b_max) - b_max  # L* (the top column's lower end, at most) less b_max
            t = t / (1 + rel) if t >= 0 else t / (1 - rel)
            thr.append(t - 2.0**-30 * abs(t) - _FLOOR)  # down; float32 below, down again
        thr32 = torch.tensor(thr, dtype=torch.float64)
        t32 = thr32.float()
        t32 = torch.where(t32.double() > thr32, torch.nextafter(t32, torch.full_like(t32, -math.inf)), t32)
        rb, bb = (blocks >= t32[:, None]).nonzero(as_tuple=True)  # the few blocks holding a candidate
        vi = (bb[:, None] * BLOCK + torch.arange(BLOCK)).clamp_(max=v - 1)  # the tail block's overhang repeats v - 1
        vals = a[rb[:, None], vi]
        c, w = self.coef
        pairs = {}  # (row, col) -> a, for the candidates: a >= the row's threshold
        thresholds = t32.tolist()
        for rr, cols_, vs in zip(rb.tolist(), vi.tolist(), vals.tolist()):
            for col, av in zip(cols_, vs):
                if av >= thresholds[rr]:
                    pairs[(rr, col)] = av
        if not pairs:
            return torch.zeros(0, dtype=torch.long), torch.zeros(r, 0, dtype=torch.bool)
        rows_l, cols_l = zip(*pairs)
        cv = c[list(cols_l)].tolist()
        wv = w[list(cols_l)].tolist()
        e = [(_REL_A * abs(av) + x[rr] * ci + y[rr] * wi + _FLOOR) * (1 + 2.0**-40)
             for (rr, _), av, ci, wi in zip(pairs, pairs.values(), cv, wv)]  # E of each candidate, float64
        lo_max = [-math.inf] * r
        for (rr, _), av, ei in zip(pairs, pairs.values(), e):
            lo_max[rr] = max(lo_max[rr], av - ei)
        kept = [(rr, col) for (rr, col), av, ei in zip(pairs, pairs.values(), e) if av + ei >= lo_max[rr]]
        cols = sorted({col for _, col in kept})
        at = {col: k for k, col in enumerate(cols)}
        keep = torch.zeros(r, len(cols), dtype=torch.bool)
        if kept:
            keep[[rr for rr, _ in kept], [at[col] for _, col in kept]] = True
        return torch.tensor(cols, dtype=torch.long), keep

    def survivors_reference(self, h: torch.Tensor, eps_x: float) -> torch.Tensor:
        """:meth:`survivors` evaluated plainly over all of ``[R, V]`` in float64: ``keep [R, V] bool`` (tests hold the
        candidate search to it)."""
        a = self.logits(h).double()
        x, y = (t[:, None] for t in _row_terms(h, eps_x))
        c, w = self.coef
        e = (_REL_A * a.abs() + x * c + y * w + _FLOOR) * (1 + 2.0**-40)
        return (a + e) >= (a - e).max(dim=1, keepdim=True).values


__all__ = ["MIN_HEAD_WEIGHTS", "Bf16FirstPass", "applies", "worth"]

"""Tree verification over a Gated DeltaNet layer in the WY (chunked) form: all root paths at once with matrix products
on tensor cores (§4.2, the paper's WY verification kernel).

:mod:`specpilot.kernels.gdn_tree`'s path kernel walks each row's root path step by step (a 32-node tree of depth 8
runs ~4x the steps of its nodes, none on tensor cores). The WY form is :func:`specpilot.model.gdn.delta_chunked` with
the causal mask replaced by the tree's ancestor mask. For rows ``t`` over the committed state ``S0`` with ``G_t`` the
sum of ``g`` along t's root path (inclusive) and ``anc(t)`` its strict ancestors:

    A[t, s] = β_t exp(G_t − G_s) (k_t · k_s)   for s ∈ anc(t), else 0        (strictly lower: parents first)
    U = (I + A)⁻¹ [β_t (v_t − exp(G_t) S0ᵀ k_t)]
    o_t = exp(G_t) S0ᵀ q_t + Σ_{s ∈ anc(t) ∪ {t}} exp(G_t − G_s) (q_t · k_s) U_s

The mask is applied before ``exp`` (a non-ancestor pair can have ``G_t − G_s > 0`` and overflow). ``A`` is nilpotent
of index ≤ the tree's depth ``d``; ``(I + A)⁻¹`` is had by the level-scheduled forward substitution
``T ← I − A T`` from ``T = I − A``, ``d − 2`` matrix products: after j of them every entry of ``T`` between rows at
most j + 1 levels apart is final. It is the ordinary triangular solve's recurrence in another order (each entry a sum
of ``A[t, s] T[s, c]`` over final ``T[s, c]``), not the product form ``(I − A)(I + A²)(I + A⁴)…``, whose powers of ``A``
grow like binomials on a chain and cancel.

- :func:`gdn_tree_wy_reference`: the WY form in plain PyTorch (float32, ``solve_triangular``); tested against
  :func:`~specpilot.kernels.gdn_tree.gdn_tree_reference` (the recurrent oracle).
- :func:`tree_mask`: the ancestor mask on the device (one small launch a pass, shared by the layers).
- :func:`gdn_tree_wy`: the Triton kernel, grid ``(value heads, layers, d_v splits)``: a program builds its head's
  ``A``, the inverse and ``P = (exp(G_t − G_s) q_t · k_s)``, then runs its d_v tiles (``S0`` products, then ``P T``
  applied to the right-hand side). A model's pass calls it per layer (a layer's inputs come from the layer below);
  one launch can also take every layer's inputs at once (``[L, ...]``, for replays and timing).

Only the outputs come from the WY form. The committed state is still advanced by
:func:`~specpilot.kernels.gdn_tree.gdn_commit`'s recurrent replay of the accepted rows, so losslessness of the state
never depends on the WY rounding (the outputs differ from the path kernel's by float32 rounding, more with the
tensor-core precisions: see ``input_precision``). Padding rows (parent :data:`~specpilot.kernels.gdn_tree.PAD`)
give zeros and read nothing. No host synchronisation.
"""

from __future__ import annotations

import torch

from specpilot.kernels.gdn_tree import PAD, _check_dims, _check_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the reference still works
    triton = None

#: most rows a tree may have (the ancestor mask, ``A`` and its inverse are one ``[N, N]`` register tile)
MAX_ROWS = 64
#: tl.dot precisions the kernel accepts: ``tf32x3`` / ``bf16x6`` split each float32 operand into pieces whose
#: products, accumulated in float32, carry (nearly) its whole mantissa; ``tf32`` / ``bf16x3`` are cheaper and
#: coarser; ``ieee`` is float32 FMA without tensor cores
PRECISIONS = ("tf32x3", "bf16x6", "bf16x3", "tf32", "ieee")
#: default tl.dot precision
PRECISION = "tf32x3"
#: padded rows N -> default (d_v tile, d_k chunk, warps) at d_k = d_v = 128, tf32x3: none spills in offline sm_90a
#: compiles (probes/gdn_wy_h200.py --ptxas); at 32 rows tile 64 took 0.95 ms over 48 layers on the H200 against 1.33
#: for tile 32, same error (results/gdn_wy_h200_2026-12-04_b5f1f3c/wy.json); 16 and 64 rows are not swept on a GPU yet
CONFIGS = {16: (64, 32, 4), 32: (64, 32, 4), 64: (32, 16, 8)}


def ancestor_mask(parents) -> torch.Tensor:
    """Inclusive ancestor mask of a forest of rows: ``[R, R]`` bool, ``[t, s]`` true when s is t or one of its
    ancestors; a padding row (:data:`PAD`) has an empty row. ``parents``: ``[R]`` ints (list or tensor, −1 a root).

    Raises:
        ValueError: a parent that is not an earlier real row (nor −1 / PAD).
    """
    parents = torch.as_tensor(parents).tolist()
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p == PAD:
            continue
        if not -1 <= p < j or (p >= 0 and not out[p, p]):
            raise ValueError(f"row {j}: parent {p} is not an earlier real row (nor -1)")
        if p >= 0:
            out[j] = out[p]
        out[j, j] = True
    return out


def gdn_tree_wy_reference(state: torch.Tensor, q, k, v, g, beta, parents) -> torch.Tensor:
    """The tree-masked WY form in plain PyTorch: same arguments and result as
    :func:`~specpilot.kernels.gdn_tree.gdn_tree_reference` (up to float32 rounding: sums run in another order).

    Args:
        state: ``[H, d_k, d_v]`` float32, the committed state (read only).
        q, k: ``[R, H, d_k]``; v: ``[R, H, d_v]``; g, beta: ``[R, H]``; all float32.
        parents: ``[R]`` ints, earlier rows, −1 for the committed state, :data:`PAD` for a padding row (zeros).
    Returns:
        ``o [R, H, d_v]`` float32.
    Raises:
        ValueError: shapes or dtypes that do not fit, a parent that is not an earlier real row.
    """
    r = _check_rows(state, q, k, v, g, beta)[0]
    anc = ancestor_mask(parents).to(state.device)
    real = anc.diagonal()
    strict = anc & ~torch.eye(r, dtype=torch.bool, device=state.device)
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, R, d]
    cum = (anc.float() @ g).t()  # [H, R]: G_t
    decay = torch.where(anc, cum[:, :, None] - cum[:, None, :], float("-inf")).exp()  # masked before exp
    d = torch.where(real, cum.exp(), 0.0)[:, :, None]  # exp(G_t), 0 on padding rows
    a = torch.where(strict, beta.t()[:, :, None] * decay * (kh @ kh.transpose(1, 2)), 0.0)
    rhs = beta.t()[:, :, None] * (vh - d * (kh @ state))
    eye = torch.eye(r, dtype=state.dtype, device=state.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    return (d * (qh @ state) + (decay * (qh @ kh.transpose(1, 2))) @ u).transpose(0, 1).contiguous()


if triton is not None:

    @triton.jit
    def _tree_mask_kernel(par_ptr, mask_ptr, R, N: tl.constexpr):
        t = tl.arange(0, N)
        par = tl.load(par_ptr + t, mask=t < R, other=-2)
        real = par >= -1
        anc = (t[:, None] == t[None, :]) & real[:, None]
        cur = tl.where(real, par, -1)
        it = 0
        while (tl.max(cur, 0) >= 0) & (it < N):  # every row's root path at once, one level an iteration
            anc = anc | (cur[:, None] == t[None, :])
            cur = tl.load(par_ptr + cur, mask=cur >= 0, other=-1)
            it += 1
        tl.store(mask_ptr + t[:, None] * N + t[None, :], anc.to(tl.int8))

    @triton.jit
    def _gdn_wy_kernel(s0_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, mask_ptr, o_ptr, R, H, N: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                       TILES: tl.constexpr, PREC: tl.constexpr):
        h = tl.program_id(0)
        layer = tl.program_id(1)
        t = tl.arange(0, N)
        anc = tl.load(mask_ptr + t[:, None] * N + t[None, :]) != 0  # inclusive ancestors (tree_mask)
        real = tl.sum((anc & (t[:, None] == t[None, :])).to(tl.int32), 1) > 0
        depth = tl.max(tl.sum(anc.to(tl.int32), 1), 0)
        row = (layer * R + t) * H + h  # [N] offsets of the rows in [L, R, H, ...]
        g = tl.load(g_ptr + row, mask=real, other=0.0)
        beta = tl.load(b_ptr + row, mask=real, other=0.0)
        cum = tl.sum(tl.where(anc, g[None, :], 0.0), 1)  # G_t
        decay = tl.where(anc, tl.exp(tl.where(anc, cum[:, None] - cum[None, :], 0.0)), 0.0)  # masked before exp
        kk = tl.zeros([N, N], tl.float32)  # k_t . k_s and q_t . k_s, d_k in chunks of BK (registers)
        qk = tl.zeros([N, N], tl.float32)
        for c in range(DK // BK):
            offs_c = c * BK + tl.arange(0, BK)
            kc = tl.load(k_ptr + row[:, None] * DK + offs_c[None, :], mask=real[:, None], other=0.0)
            qc = tl.load(q_ptr + row[:, None] * DK + offs_c[None, :], mask=real[:, None], other=0.0)
            kk += tl.dot(kc, tl.trans(kc), input_precision=PREC)
            qk += tl.dot(qc, tl.trans(kc), input_precision=PREC)
        eye = (t[:, None] == t[None, :]).to(tl.float32)
        strict = anc & (t[:, None] != t[None, :])
        a = tl.where(strict, beta[:, None] * decay * kk, 0.0)
        p = decay * qk
        inv = eye - a  # exact between rows at most one level apart
        lvl = 2
        while lvl < depth:  # one more level a product (forward substitution, level by level)
            inv = eye - tl.dot(a, inv, input_precision=PREC)
            lvl += 1
        pinv = tl.dot(p, inv, input_precision=PREC)
        d = tl.where(real, tl.exp(cum), 0.0)  # exp(G_t); padding rows give zero
        s_base = s0_ptr + (layer * H + h) * DK * DV
        for j in range(TILES):  # this program's d_v tiles
            offs_v = (tl.program_id(2) * TILES + j) * BV + tl.arange(0, BV)
            ks = tl.zeros([N, BV], tl.float32)  # S0ᵀ k_t and S0ᵀ q_t on this d_v tile
            qs = tl.zeros([N, BV], tl.float32)
            for c in range(DK // BK):
                offs_c = c * BK + tl.arange(0, BK)
                s = tl.load(s_base + offs_c[:, None] * DV + offs_v[None, :])
                kc = tl.load(k_ptr + row[:, None] * DK + offs_c[None, :], mask=real[:, None], other=0.0)
                qc = tl.load(q_ptr + row[:, None] * DK + offs_c[None, :], mask=real[:, None], other=0.0)
                ks += tl.dot(kc, s, input_precision=PREC)
                qs += tl.dot(qc, s, input_precision=PREC)
            vv = tl.load(v_ptr + row[:, None] * DV + offs_v[None, :], mask=real[:, None], other=0.0)
            w = beta[:, None] * (vv - d[:, None] * ks)
            o = d[:, None] * qs + tl.dot(pinv, w, input_precision=PREC)
            tl.store(o_ptr + row[:, None] * DV + offs_v[None, :], o, mask=(t < R)[:, None])


def padded_rows(r: int) -> int:
    """Rows ``r`` padded as the kernel pads them: a power of two >= 16."""
    return max(16, 1 << max(r - 1, 0).bit_length())


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """The inclusive ancestor mask of a forest of rows on the device, as the kernel reads it: ``parents [R]`` int32
    (−1 a root, :data:`PAD` padding) -> ``[N, N]`` int8, ``N`` = :func:`padded_rows` (R), ``[t, s]`` 1 when s is t
    or an ancestor of t; padding rows and rows past R are all zero. One single-program launch; a pass computes it
    once and hands it to every layer's :func:`gdn_tree_wy`. Graph-capturable; parents are not checked.

    Raises:
        ValueError: ``parents`` not int32 ``[R]`` or more than :data:`MAX_ROWS` rows; RuntimeError: no triton.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if parents.dim() != 1 or parents.dtype != torch.int32 or parents.numel() > MAX_ROWS:
        raise ValueError(f"parents must be int32 [R], R <= {MAX_ROWS}; got {parents.dtype} {tuple(parents.shape)}")
    n = padded_rows(parents.numel())
    out = torch.empty(n, n, dtype=torch.int8, device=parents.device)
    _tree_mask_kernel[(1,)](parents.contiguous(), out, parents.numel(), N=n, num_warps=1)
    return out


def gdn_tree_wy(state: torch.Tensor, q, k, v, g, beta, parents: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, block_v: int | None = None,
                block_k: int | None = None, num_warps: int | None = None, v_split: int | None = None,
                input_precision: str = PRECISION) -> torch.Tensor:
    """Triton WY verification of one GDN layer, or of every layer of a pass in one launch.

    Args:
        state: ``[H, d_k, d_v]`` or ``[L, H, d_k, d_v]`` float32, the committed state (read, never written).
        q, k: ``[R, H, d_k]`` (``[L, R, H, d_k]`` with a 4-d state); v: ``[(L,) R, H, d_v]``; g, beta:
            ``[(L,) R, H]``; float32, as :func:`~specpilot.kernels.gdn_tree.gdn_tree` takes them (``g`` the log
            decay, not its exp).
        parents: ``[R]`` int32 on the state's device; not checked on the host (each must be −1, :data:`PAD` or an
            earlier real row); or instead ``mask``, its :func:`tree_mask` (computed once per pass, shared by the
            layers; from parents it is one more launch a call). Rows are padded to :func:`padded_rows` inside.
        block_v: d_v tile of the loop inside a program (capped at d_v); block_k: d_k chunk of the products over
            d_k (capped at d_k; a power of two >= 16); num_warps: warps a program; None: :data:`CONFIGS`' entry;
        v_split: programs a head's d_v tiles are spread over (each rebuilds the head's ``A`` and inverse); None:
            one tile a program for a single layer (H programs alone would leave most SMs idle), 1 for all layers
            in one launch (H L programs);
        input_precision: one of :data:`PRECISIONS` for every tl.dot.
    Returns:
        ``o``, ``v``'s shape, float32 (padding rows zero). Equal to
        :func:`~specpilot.kernels.gdn_tree.gdn_tree_reference` up to rounding, not bit for bit: the state must be
        committed by :func:`~specpilot.kernels.gdn_tree.gdn_commit`'s replay, never from these outputs.
    Raises:
        ValueError: shapes, dtypes or dims that do not fit, more than :data:`MAX_ROWS` rows, an unknown
            precision; RuntimeError: triton not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    r, h, dk, dv = _check_rows(state, q, k, v, g, beta)
    n = padded_rows(r)
    bv, bk, nw = CONFIGS[min(n, MAX_ROWS)]
    block_v, block_k = min(block_v or bv, dv), min(block_k or bk, dk)
    _check_dims(dk, dv, block_v)
    if block_k < 16 or block_k & (block_k - 1) or dk % block_k:
        raise ValueError(f"the d_k chunk {block_k} must be a power of two >= 16 dividing d_k {dk}")
    if state.dim() not in (3, 4) or q.dim() != state.dim() or (state.dim() == 4 and q.shape[0] != state.shape[0]):
        raise ValueError(f"want state [H, d_k, d_v] with q/k/v [R, H, d] or state [L, H, d_k, d_v] with "
                         f"[L, R, H, d]; got {tuple(state.shape)} and {tuple(q.shape)}")
    if r > MAX_ROWS:
        raise ValueError(f"the WY kernel takes at most {MAX_ROWS} rows, got {r}")
    if (parents is None) == (mask is None):
        raise ValueError("give the rows' parents or their tree_mask, one of the two")
    if parents is not None and (tuple(parents.shape) != (r,) or parents.dtype != torch.int32):
        raise ValueError(f"want parents int32 [{r}], got {parents.dtype} {tuple(parents.shape)}")
    if mask is not None and (tuple(mask.shape) != (n, n) or mask.dtype != torch.int8):
        raise ValueError(f"want a tree_mask int8 [{n}, {n}] for {r} rows, got {mask.dtype} {tuple(mask.shape)}")
    layers = 1 if state.dim() == 3 else state.shape[0]
    tiles = dv // block_v
    v_split = (tiles if layers == 1 else 1) if v_split is None else v_split
    if v_split < 1 or tiles % v_split:
        raise ValueError(f"v_split {v_split} must divide the {tiles} d_v tiles")
    if input_precision not in PRECISIONS:
        raise ValueError(f"input_precision must be one of {PRECISIONS}, got {input_precision!r}")
    out = torch.empty_like(v)
    if r:
        c = lambda t: t.contiguous()  # noqa: E731
        _gdn_wy_kernel[(h, layers, v_split)](
            c(state), c(q), c(k), c(v), c(g), c(beta), c(tree_mask(parents) if mask is None else mask), out, r, h,
            N=n, DK=dk, DV=dv, BV=block_v, BK=block_k, TILES=tiles // v_split, PREC=input_precision,
            num_warps=num_warps or nw)
    return out

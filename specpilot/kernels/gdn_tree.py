"""Tree verification over a Gated DeltaNet layer without per-node states: path recompute and commit replay (§4.2).

A GDN value head carries a float32 state ``S [d_k, d_v]``; a row of a verified tree needs the state at the end of its
root path. Instead of keeping one state per node (stock snapshots: 18 GB at 24 nodes on the paper's target), each
program recomputes its row's state along the root path from the committed state, in registers, and writes only the
row's output; the commit replays the accepted path's steps into the committed state. The commit IS the path kernel
(one compiled kernel, a runtime flag that also writes the final state back), so the committed state is the one the
path kernel computed for the accepted row, and the next pass's outputs from it equal what a longer path from the old
state gives (tests/test_gdn_kernels.py checks this bit for bit). A separate commit kernel of the same source did not:
on the H200 at one warp its state differed in the last bits.

Per row and value head the step is, with ``α = exp(g)`` (taken in PyTorch, as the reference does)

    S ← α S;   S ← S + k (β (v − Sᵀ k))ᵀ;   o = Sᵀ q.

- :func:`gdn_tree_reference` / :func:`gdn_commit_reference`: plain PyTorch over :func:`delta_step`; the oracles.
- :func:`gdn_tree`: the path kernel, grid ``(rows, value heads, d_v tiles)``; each program walks its row's root path
  (depth ≤ rows) from the committed state and writes ``o`` only. The committed state is read, never written. The
  paths come from :func:`root_paths` (one launch a pass, shared by every layer).
- :func:`gdn_commit`: the path kernel over one row, the accepted path, grid ``(1, value heads, d_v tiles x layers)``,
  its state written back into every GDN layer's committed state in place, one launch for all layers.

Padding, so that one CUDA graph per row bucket serves any tree: a row whose parent is :data:`PAD` is skipped (output
zero, nothing read); a commit's row list may end in entries < 0 (the path stops there). Neither kernel synchronises with the host.
"""

from __future__ import annotations

import torch

from specpilot.model.gdn import delta_step

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the references still work
    triton = None

#: parent index of a padding row (−1 is a root over the committed state)
PAD = -2


def _check_dims(dk: int, dv: int, block_v: int) -> None:
    """ValueError unless ``d_k``, ``d_v`` and the d_v tile are powers of two with the tile dividing ``d_v``."""
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(dk) and pow2(dv) and pow2(block_v) and dv % block_v == 0 and dk >= 16 and block_v >= 16):
        raise ValueError(f"d_k {dk}, d_v {dv} and the d_v tile {block_v} must be powers of two >= 16, the tile "
                         f"dividing d_v")


def _check_rows(state, q, k, v, g, beta, rows: int | None = None) -> tuple[int, int, int, int]:
    """Shared shape checks; returns ``(R, H, d_k, d_v)``. Raises ValueError."""
    h, dk, dv = state.shape[-3:]
    r = k.shape[-3]
    want = {"k": (r, h, dk), "v": (r, h, dv), "g": (r, h), "beta": (r, h)}
    if q is not None:
        want["q"] = (r, h, dk)
    got = {"k": k, "v": v, "g": g, "beta": beta, "q": q}
    for name, shape in want.items():
        t = got[name]
        if tuple(t.shape[-len(shape):]) != shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [..., {', '.join(map(str, shape))}] for a state "
                             f"{tuple(state.shape)}, got {t.dtype} {tuple(t.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"the GDN state must be float32, got {state.dtype}")
    return r, h, dk, dv


def gdn_tree_reference(state: torch.Tensor, q, k, v, g, beta, parents) -> torch.Tensor:
    """Outputs of a forest of rows over the committed state, as :class:`~specpilot.model.gdn.GatedDeltaNet` computes
    them: each row's state one :func:`delta_step` from its parent's (all rows' states held while the pass runs).

    Args:
        state: ``[H, d_k, d_v]`` float32, the committed state (read only).
        q, k: ``[R, H, d_k]`` float32 (normalised as the reference does); v: ``[R, H, d_v]`` float32;
            g, beta: ``[R, H]`` float32 (log decay, write strength).
        parents: ``[R]`` ints (list or tensor): a row's parent row (earlier than it), −1 for the committed state,
            :data:`PAD` for a padding row (output zero).
    Returns:
        ``o [R, H, d_v]`` float32.
    Raises:
        ValueError: shapes or dtypes that do not fit, a parent that is not an earlier row.
    """
    r = _check_rows(state, q, k, v, g, beta)[0]
    parents = torch.as_tensor(parents).tolist()
    out = torch.zeros_like(v)
    states: dict[int, torch.Tensor] = {}
    for j, p in enumerate(parents):
        if p == PAD:
            continue
        if not -1 <= p < j or (p >= 0 and p not in states):
            raise ValueError(f"row {j}: parent {p} is not an earlier real row (nor -1)")
        states[j], out[j] = delta_step(state if p < 0 else states[p], q[j], k[j], v[j], g[j], beta[j])
    return out


def gdn_commit_reference(state: torch.Tensor, k, v, g, beta, rows) -> torch.Tensor:
    """The committed state after the accepted rows' steps, replayed with :func:`delta_step` (what
    :meth:`~specpilot.model.hybrid_cache.HybridCache.commit` does in ``replay`` mode).

    Args:
        state: ``[L, H, d_k, d_v]`` (or ``[H, d_k, d_v]``) float32, committed state per layer (read only).
        k, v, g, beta: the pass's step inputs per layer, ``[L, R, H, d_k]`` / ``[L, R, H, d_v]`` / ``[L, R, H]``
            (no ``L`` for a 3-d state), float32.
        rows: ``[n]`` ints, the accepted path's rows root first; entries < 0 are skipped (padding).
    Returns:
        the new state, ``state``'s shape, float32 (a new tensor).
    """
    _check_rows(state, None, k, v, g, beta)
    one = state.dim() == 3
    s_all, k, v, g, beta = (t.unsqueeze(0) if one else t for t in (state, k, v, g, beta))
    new = []
    for layer in range(s_all.shape[0]):
        s = s_all[layer]
        for j in (int(x) for x in torch.as_tensor(rows).tolist() if x >= 0):
            s = delta_step(s, k[layer, j], k[layer, j], v[layer, j], g[layer, j], beta[layer, j])[0]  # o unused
        new.append(s)
    out = torch.stack(new)
    return out[0] if one else out


if triton is not None:

    @triton.jit
    def _delta_step(s, kk, vv, alpha, beta):
        """One delta-rule step on a ``[DK, BV]`` state tile, in :func:`delta_step`'s operation order."""
        s = s * alpha
        kv = tl.sum(s * kk[:, None], axis=0)
        return s + kk[:, None] * ((vv - kv) * beta)[None, :]

    @triton.jit
    def _root_paths_kernel(par_ptr, paths_ptr, W: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.arange(0, W)
        path = tl.full([W], -1, tl.int32)
        if tl.load(par_ptr + row) >= -1:  # a real row (a padding row's path stays empty)
            depth = 0
            a = row
            while a >= 0:
                depth += 1
                a = tl.load(par_ptr + a)
            a = row
            while a >= 0:  # leaf first, written root first
                depth -= 1
                path = tl.where(idx == depth, a, path)
                a = tl.load(par_ptr + a)
        tl.store(paths_ptr + row * W + idx, path)

    @triton.jit(do_not_specialize=["COMMIT"])
    def _gdn_path_kernel(s0_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, paths_ptr, o_ptr, COMMIT, H, R_IN, TILES,
                         DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, W: tl.constexpr):
        # grid (rows, value heads, d_v tiles x layers); step inputs [L, R_IN, H, d], states [L, H, DK, DV], o [L, rows,
        # H, DV]. With COMMIT (not specialised on, so one compiled kernel serves both uses) the row's final state is
        # also written back over its layer's state: the commit, by the very instructions a verify pass runs.
        row = tl.program_id(0)
        h = tl.program_id(1)
        layer = tl.program_id(2) // TILES
        offs_k = tl.arange(0, DK)
        offs_v = (tl.program_id(2) % TILES) * BV + tl.arange(0, BV)
        out = ((layer * tl.num_programs(0) + row) * H + h) * DV + offs_v
        node = tl.load(paths_ptr + row * W)
        if node >= 0:  # a real row (a padding row writes zeros)
            tile = s0_ptr + (layer * H + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
            s = tl.load(tile)
            i = 1
            while node >= 0:  # root first, as many steps as the row's depth; −1 past the row
                nxt = tl.load(paths_ptr + row * W + i, mask=i < W, other=-1)  # ahead of the step it does not need
                nh = (layer * R_IN + node) * H + h
                kk = tl.load(k_ptr + nh * DK + offs_k)
                vv = tl.load(v_ptr + nh * DV + offs_v)
                s = _delta_step(s, kk, vv, tl.load(a_ptr + nh), tl.load(b_ptr + nh))
                node = nxt
                i += 1
            qq = tl.load(q_ptr + ((layer * R_IN + row) * H + h) * DK + offs_k)
            tl.store(o_ptr + out, tl.sum(s * qq[:, None], axis=0))
            if COMMIT != 0:
                tl.store(tile, s)
        else:
            tl.store(o_ptr + out, tl.zeros([BV], tl.float32))


#: d_v tile (capped at d_v) and warps of both kernels: they must agree for the commit to equal the path kernel's state
#: bit for bit (tile and warps fix the layout, so the order of the sums over d_k). One warp: on the H200, 48 GDN layers
#: of a 32-node tree took 1.62 ms at (32, 1) against 2.07 at (32, 4) (results/gdn_kernels_h200_2026-12-04_2753794/)
BLOCK_V, NUM_WARPS = 32, 1


def root_paths(parents: torch.Tensor) -> torch.Tensor:
    """Each row's root path, root first: ``parents [R]`` int32 (device) -> ``[R, W]`` int32, ``W`` = R rounded up to
    a power of two, entries past the row −1 (a padding row's path is empty). One launch of R single-warp
    programs; a pass computes it once and hands it to every layer's :func:`gdn_tree`. Graph-capturable.

    Raises:
        ValueError: ``parents`` not int32 ``[R]``; RuntimeError: triton not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if parents.dim() != 1 or parents.dtype != torch.int32:
        raise ValueError(f"parents must be int32 [R], got {parents.dtype} {tuple(parents.shape)}")
    r = parents.numel()
    w = triton.next_power_of_2(max(r, 1))
    paths = torch.empty(r, w, dtype=torch.int32, device=parents.device)
    if r:
        _root_paths_kernel[(r,)](parents.contiguous(), paths, W=w, num_warps=1)
    return paths


def gdn_tree(state: torch.Tensor, q, k, v, g, beta, parents: torch.Tensor | None = None, *,
             paths: torch.Tensor | None = None, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Triton path verification of one GDN layer; same arguments and result as :func:`gdn_tree_reference`, with
    ``parents`` an int32 tensor ``[R]`` on the state's device, or instead ``paths``, its :func:`root_paths`
    (computed once per pass, shared by the layers). Parents are not checked on the host: each must be −1,
    :data:`PAD` or an earlier real row, else the walk reads garbage. ``state`` is read, never written.

    Raises:
        ValueError: shapes, dtypes or dims that do not fit, neither or both of parents / paths; RuntimeError:
            triton not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    r, h, dk, dv = _check_rows(state, q, k, v, g, beta)
    block_v = min(block_v, dv)
    _check_dims(dk, dv, block_v)
    if (parents is None) == (paths is None):
        raise ValueError("give the rows' parents or their root_paths, one of the two")
    if paths is None:
        if tuple(parents.shape) != (r,) or parents.dtype != torch.int32:
            raise ValueError(f"want parents int32 [{r}], got {parents.dtype} {tuple(parents.shape)}")
        paths = root_paths(parents)
    if state.dim() != 3 or q.dim() != 3 or paths.dtype != torch.int32 or paths.dim() != 2 or paths.shape[0] != r:
        raise ValueError(f"want state [H, d_k, d_v], q/k/v [R, H, d] and paths int32 [{r}, W]; got "
                         f"{tuple(state.shape)}, {tuple(q.shape)}, {paths.dtype} {tuple(paths.shape)}")
    out = torch.empty_like(v)
    if r:
        c = lambda t: t.contiguous()  # noqa: E731
        _gdn_path_kernel[(r, h, dv // block_v)](
            c(state), c(q), c(k), c(v), c(g.exp()), c(beta), c(paths), out, 0, h, r, dv // block_v,
            DK=dk, DV=dv, BV=block_v, W=paths.shape[1], num_warps=num_warps)
    return out


def gdn_commit(state: torch.Tensor, k, v, g, beta, rows: torch.Tensor, *, block_v: int = BLOCK_V,
               num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Triton commit: the accepted rows' steps applied to ``state`` **in place** (every layer, one launch).

    It is the path kernel itself, run for one row whose root path is ``rows`` with its state written back: the
    same compiled instructions as the verify pass (``W`` the pass's own width, ``next_power_of_2(R)``), so the
    committed state is bit for bit the pass's state of the accepted row (two kernels of the same source can differ:
    a separate commit kernel did at one warp on the H200).

    Args:
        state: ``[L, H, d_k, d_v]`` or ``[H, d_k, d_v]`` float32, contiguous; overwritten with the new state.
        k, v, g, beta: as :func:`gdn_commit_reference`.
        rows: ``[n]`` int32 tensor on the state's device, ``n <= R``: the accepted rows root first (each the previous
            one's child), then any padding < 0, so a fixed ``n`` serves any accepted length.
    Returns:
        ``state`` (the same tensor).
    Raises:
        ValueError: shapes, dtypes or dims that do not fit, a non-contiguous state; RuntimeError: no triton.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    r, h, dk, dv = _check_rows(state, None, k, v, g, beta)
    block_v = min(block_v, dv)
    _check_dims(dk, dv, block_v)
    layers = 1 if state.dim() == 3 else state.shape[0]
    if state.dim() not in (3, 4) or k.dim() != state.dim() or (state.dim() == 4 and k.shape[0] != layers):
        raise ValueError(f"want state [L, H, d_k, d_v] with step inputs [L, R, H, ...] (or neither with L); got "
                         f"{tuple(state.shape)} and {tuple(k.shape)}")
    if not state.is_contiguous() or rows.dim() != 1 or rows.dtype != torch.int32:
        raise ValueError(f"want a contiguous state and rows int32 [n]; got rows {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() > max(r, 1):
        raise ValueError(f"{rows.numel()} accepted rows for a pass of {r}")
    if rows.numel() and r:
        c = lambda t: t.contiguous()  # noqa: E731
        w = triton.next_power_of_2(r)
        path = torch.cat((rows, rows.new_full((w - rows.numel(),), -1)))[None]  # [1, W], −1 past the path
        scratch = torch.empty(layers, 1, h, dv, dtype=torch.float32, device=state.device)  # its o, unused
        _gdn_path_kernel[(1, h, dv // block_v * layers)](
            state, c(k), c(k), c(v), c(g.exp()), c(beta), path, scratch, 1, h, r, dv // block_v,
            DK=dk, DV=dv, BV=block_v, W=w, num_warps=num_warps)
    return state

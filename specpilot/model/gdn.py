"""A Gated DeltaNet (GDN) layer in plain PyTorch: the recurrent reference over any tree of rows (§4.2).

Per token ``t`` of a root path, per value head, the state ``S [d_k, d_v]`` (float32) follows the gated delta rule

    S ← exp(g_t) · S;   S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ;   o_t = Sᵀ q_t

with ``q, k`` L2-normalised (q also scaled by ``d_k^-½``), ``β = sigmoid(b)`` and ``g = −exp(A_log) · softplus(a +
dt_bias)``. q, k, v come out of a short depthwise causal conv (kernel K, SiLU) over the layer's projected input; the
conv of a row reads the K − 1 inputs before it *on its root path* (its ancestors, then the committed window). The
output is RMS-normed per head, gated by ``silu(z)`` and projected out. Parameter names are Hugging Face's
(``linear_attn.*`` of a qwen3_5 decoder layer; qwen3_next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` are split into
them on loading, :func:`split_grouped_projections`).

Rows form a forest over the committed state: ``parents[j]`` is row j's parent row, −1 for a root (the state and
conv window the cache has committed). A causal pass (prefill, AR, a chain) is the forest where ``parents[j] = j − 1``.
Each row's state is computed from its parent's by one delta-rule step, so a row's state is bit for bit the state a
recurrent replay of its root path gives (:meth:`~specpilot.model.hybrid_cache.HybridCache.commit` replays that way).
A long causal prefill runs the chunked form instead (:func:`delta_chunked`), whose rounding differs.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.model.args import ModelArgs
from specpilot.model.layers import fused_linear


def parents_from_mask(mask: torch.Tensor | None, start: int, r: int) -> list[int]:
    """Parent row of each of ``r`` rows: ``mask [r, start + r]`` bool (its ``[:, start:]`` part the ancestor mask
    among the rows, self included) or None for causal rows. Returns ``[r]`` ints, −1 = a root over the committed
    state. A row's parent is its nearest (highest-index) ancestor row; rows list parents before children."""
    if mask is None:
        return list(range(-1, r - 1))
    anc = mask[:, start:].to("cpu").clone()
    anc.fill_diagonal_(False)
    idx = torch.arange(r)
    return torch.where(anc.any(1), torch.where(anc, idx, -1).amax(1), -1).tolist()


def conv_index(parents: list[int], k: int) -> torch.Tensor:
    """``[r, k] long`` indices into ``cat(window [k − 1, C], inputs [r, C])``: row j's conv reads, oldest first, the
    k − 1 inputs before it on its root path, then itself (window entry i is input ``i − (k − 1)`` before the rows)."""
    out = torch.empty(len(parents), k, dtype=torch.long)
    for j in range(len(parents)):
        x = k - 1 + j
        for t in range(k - 1, -1, -1):
            out[j, t] = x
            x = (k - 1 + parents[x - k + 1] if parents[x - k + 1] >= 0 else k - 2) if x >= k - 1 else x - 1
    return out


def delta_step(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta-rule token. ``state [H, d_k, d_v]`` float32; ``q, k [H, d_k]``, ``v [H, d_v]``, ``g, beta
    [H]`` float32 (q, k normalised already). Returns ``(new state [H, d_k, d_v], output [H, d_v])`` float32."""
    s = state * g.exp()[:, None, None]
    kv = (s * k[:, :, None]).sum(1)
    s = s + k[:, :, None] * ((v - kv) * beta[:, None])[:, None, :]
    return s, (s * q[:, :, None]).sum(1)


def delta_chunked(state: torch.Tensor, q, k, v, g, beta, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a causal run of tokens, ``chunk`` tokens at a time (the prefill form).

    Within a chunk of L tokens with cumulative log decay ``G`` (``D = exp(G)``) and start state ``S0``, the
    corrections ``U`` solve the unit lower-triangular system ``(I + A) U = β ⊙ (V − (D ⊙ K) S0)`` with
    ``A[t, s] = β_t exp(G_t − G_s) k_tᵀ k_s`` (s < t); then ``O = (D ⊙ Q) S0 + (M ⊙ Q Kᵀ) U`` with
    ``M[t, s] = exp(G_t − G_s)`` (s ≤ t) and ``S_L = D_L S0 + (exp(G_L − G) ⊙ K)ᵀ U``. Equal to :func:`delta_step`
    token by token up to float32 rounding (a different summation order, not the same bits).

    Args:
        state: ``[H, d_k, d_v]`` float32 start state; q, k ``[T, H, d_k]``, v ``[T, H, d_v]``, g, beta ``[T, H]``,
            all float32 (q, k normalised already); chunk: tokens per chunk.
    Returns:
        ``(state after the T tokens [H, d_k, d_v], outputs [T, H, d_v])`` float32.
    """
    outs = []
    for c0 in range(0, q.shape[0], chunk):
        qc, kc, vc = (t[c0 : c0 + chunk].transpose(0, 1) for t in (q, k, v))  # [H, L, d]
        gc, bc = g[c0 : c0 + chunk].t(), beta[c0 : c0 + chunk].t()  # [H, L]
        n = qc.shape[1]
        cum = gc.cumsum(-1)
        decay = (cum[:, :, None] - cum[:, None, :])  # [H, L, L]: G_t − G_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        m = torch.where(lower, decay, float("-inf")).exp()
        a = (bc[:, :, None] * m * (kc @ kc.transpose(1, 2))).masked_fill(lower.logical_not().logical_or(
            torch.eye(n, dtype=torch.bool, device=q.device)), 0.0)
        rhs = bc[:, :, None] * (vc - (cum.exp()[:, :, None] * kc) @ state)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append(((cum.exp()[:, :, None] * qc) @ state + (m * (qc @ kc.transpose(1, 2))) @ u).transpose(0, 1))
        state = cum[:, -1:, None].exp() * state + ((cum[:, -1:] - cum).exp()[:, :, None] * kc).transpose(1, 2) @ u
    return state, torch.cat(outs)


def split_grouped_projections(qkvz: torch.Tensor, ba: torch.Tensor, hk: int, hv: int, dk: int, dv: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qwen3_next's fused GDN input projections in qwen3_5's layout (a row permutation: the same weights).

    qwen3_next stores ``in_proj_qkvz`` grouped by key head — per key head ``[q (d_k), k (d_k), v (r d_v), z (r d_v)]``
    with ``r = hv / hk`` value heads per key head — and ``in_proj_ba`` as ``[b (r), a (r)]`` per key head; qwen3_5
    (:class:`GatedDeltaNet`) keeps ``in_proj_qkv`` as all q heads, all k heads, all v heads, and z, b, a apart. Value
    head ``i · r + j`` is key head i's j-th in both.

    Args:
        qkvz: ``[2 hk dk + 2 hv dv, hidden]``; ba: ``[2 hv, hidden]``; hk / hv: key / value heads; dk / dv: their dims.
    Returns:
        ``(in_proj_qkv [2 hk dk + hv dv, hidden], in_proj_z [hv dv, hidden], in_proj_b [hv, hidden],
        in_proj_a [hv, hidden])``, same dtype.
    Raises:
        ValueError: the shapes do not fit the head counts and dims.
    """
    h, r = qkvz.shape[-1], hv // hk
    if hv % hk or qkvz.shape != (2 * hk * dk + 2 * hv * dv, h) or ba.shape != (2 * hv, h):
        raise ValueError(f"in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not fit {hk} key "
                         f"heads of {dk} and {hv} value heads of {dv}")
    q, k, v, z = qkvz.reshape(hk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(hk, 2 * r, h).split([r, r], dim=1)
    qkv = torch.cat([t.reshape(-1, h) for t in (q, k, v)])
    return qkv, z.reshape(-1, h), b.reshape(-1, h), a.reshape(-1, h)


class GatedRMSNorm(nn.Module):
    """Per-head RMS norm of the GDN output, then ``· silu(z)`` (weight as stored, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x, z [..., dim]`` -> same shape and dtype as ``x``."""
        dt = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dt)
        return (h * F.silu(z.float())).to(dt)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer of a hybrid decoder layer (HF's ``linear_attn``).

    Shapes: ``H_k = linear_num_key_heads``, ``H = linear_num_value_heads`` (each key head serves ``H / H_k`` value
    heads), conv channels ``C = 2 H_k d_k + H d_v``.
    """

    #: causal passes of at least this many rows, keeping no state but the last, run :func:`delta_chunked`
    CHUNKED_ROWS = 128

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        h, kd, vd = args.hidden_size, self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * kd + vd
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, vd, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(vd, h, bias=False)

    def fuse(self) -> None:
        """Replace the four input projections by one ``in_proj`` (weights concatenated on the output dim: one GEMM
        instead of four, two of them only ``hv`` wide), same results up to GEMM blocking. Idempotent."""
        if "in_proj" in self._modules:
            return
        self.in_proj = fused_linear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw input projections of ``x [R, hidden]``, model dtype: ``(mixed [R, C], z [R, H, d_v], b [R, H],
        a [R, H])`` (column views of one GEMM's output when fused; the static pass's fused kernel takes the gates
        from here, :func:`~specpilot.kernels.hybrid_glue.gdn_premix`)."""
        r = x.shape[0]
        if "in_proj" in self._modules:
            mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.hv * self.dv, self.hv, self.hv], dim=-1)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return mixed, z.reshape(r, self.hv, self.dv), b, a

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of ``x [R, hidden]``: ``(mixed [R, C]`` (the conv's input, model dtype), ``z [R, H, d_v]``,
        ``g [R, H]`` float32 (log decay), ``beta [R, H]`` float32)."""
        mixed, z, b, a = self.project(x)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return mixed, z, g, beta

    def conv(self, window: torch.Tensor, mixed: torch.Tensor, parents: list[int]) -> torch.Tensor:
        """Depthwise causal conv + SiLU along each row's root path. ``window [K − 1, C]`` (the committed inputs,
        oldest first), ``mixed [R, C]`` -> ``[R, C]`` in ``mixed``'s dtype."""
        seq = torch.cat((window.to(mixed.dtype), mixed))
        idx = conv_index(parents, self.kernel).to(mixed.device)
        w = self.conv1d.weight[:, 0, :]  # [C, K]
        return F.silu((seq[idx] * w.t()[None]).sum(1))

    def qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the conv output ``[R, C]`` into float32 ``q, k [R, H, d_k]`` (L2-normalised, q scaled by
        ``d_k^-½``, key heads repeated for their value heads) and ``v [R, H, d_v]``."""
        r, kd = conv_out.shape[0], self.hk * self.dk
        q, k, v = conv_out.float().split([kd, kd, self.hv * self.dv], dim=-1)
        rep = self.hv // self.hk
        q = q.reshape(r, self.hk, self.dk).repeat_interleave(rep, dim=1)
        k = k.reshape(r, self.hk, self.dk).repeat_interleave(rep, dim=1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / self.dk**0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.reshape(r, self.hv, self.dv)

    def forward(self, x: torch.Tensor, state: torch.Tensor, window: torch.Tensor, parents: list[int],
                record=None, keep: Collection[int] = ()) -> torch.Tensor:
        """Eager reference pass over a forest of rows: :meth:`inputs`, then :meth:`mix` (delta-rule steps row by
        row, or the chunked form for a prefill), then :meth:`output`.

        Args:
            x: ``[R, hidden]`` (normed layer input).
            state, window, parents, record, keep: as :meth:`mix`.
        Returns:
            ``[R, hidden]`` in ``x``'s dtype.
        """
        mixed, z, g, beta = self.inputs(x)
        return self.output(self.mix(mixed, g, beta, state, window, parents, record, keep), z)

    def mix(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
            window: torch.Tensor, parents: list[int], record=None, keep: Collection[int] = ()) -> torch.Tensor:
        """The token mixing of one request's rows (the part that reads its state): conv along each root path, then
        delta-rule steps row by row, except a causal pass of at least :attr:`CHUNKED_ROWS` rows that keeps no state
        but its last (a prefill), which runs :func:`delta_chunked` (same values up to float32 rounding). A batched
        pass (:mod:`specpilot.model.hybrid_batch`) runs :meth:`inputs` and :meth:`output` over every request's rows
        at once and this per request.

        Args:
            mixed, g, beta: this request's rows of :meth:`inputs` (``[R, C]``, ``[R, H]``, ``[R, H]``).
            state: ``[H, d_k, d_v]`` float32, the committed recurrent state (read only).
            window: ``[K − 1, C]``, the committed conv inputs (read only).
            parents: ``[R]`` ints, each row's parent row (−1: the committed state), parents before children.
            record: None, or a callable ``record(mixed [R, C], step_inputs, states)`` that an exact pass hands what
                its commit needs: the conv inputs, the per-row delta-rule inputs ``(q, k, v, g, beta)`` and
                ``states``, a dict row -> ``[H, d_k, d_v]`` holding the states of the rows in ``keep``.
            keep: rows whose states ``record`` receives; any other row's state is dropped once its last child
                has read it (a causal prefill holds one state at a time).
        Returns:
            ``[R, H, d_v]`` float32, the rows' delta-rule outputs.
        """
        r = mixed.shape[0]
        q, k, v = self.qkv(self.conv(window, mixed, parents))
        last_read = {p: j for j, p in enumerate(parents)}  # row -> its last child (parents before children)
        keep = set(keep)
        states: dict[int, torch.Tensor] = {}
        outs, steps = [], r
        if r >= self.CHUNKED_ROWS and keep <= {r - 1} and parents == list(range(-1, r - 1)):  # a causal prefill
            states[r - 1], o = delta_chunked(state, q, k, v, g, beta)
            outs, steps = list(o), 0
        for j in range(steps):
            p = parents[j]
            s, o = delta_step(state if p < 0 else states[p], q[j], k[j], v[j], g[j], beta[j])
            if p >= 0 and last_read[p] == j and p not in keep:
                del states[p]
            if j in last_read or j in keep:
                states[j] = s
            outs.append(o)
        if record is not None:
            record(mixed, (q, k, v, g, beta), states)
        return torch.stack(outs)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated per-head norm and the out projection: ``o [R, H, d_v]`` float32 (:meth:`mix`), ``z [R, H, d_v]``
        (:meth:`inputs`) -> ``[R, hidden]`` in ``z``'s dtype."""
        o = self.norm(o.to(z.dtype), z)
        return self.out_proj(o.reshape(o.shape[0], self.hv * self.dv))

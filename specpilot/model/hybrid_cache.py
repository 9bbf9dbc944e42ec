"""The target state of one request on a hybrid model: K/V of the attention layers, recurrent state and conv window of
the Gated DeltaNet (GDN) layers, under :class:`~specpilot.model.cache.KVCache`'s contract (§4.2).

What is committed: K/V slots ``[0, length)``, and per GDN layer the state ``S`` and the conv window after the
``length`` committed tokens (equal to a fresh prefill of them). What is scratch: K/V slots at or past the length,
and what the last exact pass recorded (its rows' conv inputs, delta-rule inputs and some rows' states). A pass
never changes the committed GDN state; :meth:`HybridCache.commit` moves it along the accepted root path:

- ``snapshot`` (stock chain verification): the pass kept every row's state; commit takes the accepted row's;
- ``replay`` (tree verification without per-node snapshots): the pass kept only its last row's state; commit
  replays the accepted path's delta-rule steps from the committed state, the same steps (so the same bits) the
  pass computed for those rows. The conv window follows the path in both modes.

A static pass (:mod:`~specpilot.model.hybrid_static`, the row-bucket / CUDA-graph path) keeps no per-row state in
either mode: it writes its rows' step and conv inputs into the bucket's :class:`StaticRecord`, and its commit
replays the accepted path from them (``gdn_commit`` when :attr:`HybridCache.gdn_kernels`, else the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specpilot.model.args import ModelArgs
from specpilot.model.gdn import delta_step

if TYPE_CHECKING:  # the static pass imports the Triton kernels: only a static pass loads it (a CPU benchmark must
    from specpilot.model.hybrid_static import StaticRecord  # choose Triton's interpreter before Triton is imported)

VERIFY_MODES = ("snapshot", "replay")


class HybridCache:
    """Per-request state of a hybrid target.

    Attributes:
        k, v: ``[n_attn, max_len, n_kv_heads, head_dim]``, the full-attention layers' K/V (slot = position).
        state: ``[n_gdn, H, d_k, d_v]`` float32, committed GDN states.
        window: ``[n_gdn, K − 1, C]``, committed conv inputs (oldest first), model dtype.
        gdn_kernels: static passes run the GDN path / commit kernels (else the PyTorch reference); one choice
            for both, so the commit replays the bits the pass computed.
    Args:
        args: a hybrid :class:`ModelArgs`; max_len: K/V slots; mode: ``snapshot`` | ``replay`` (module doc);
        gdn_kernels: None = on CUDA with triton installed and GDN dims the kernels take (powers of two >= 16).
    Raises:
        ValueError: ``max_len < 1`` or an unknown mode.
    """

    #: most rows of a pass whose states ``snapshot`` mode keeps (more than a verified tree, fewer than a prompt)
    SNAPSHOT_ROWS = 256

    def __init__(self, args: ModelArgs, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 mode: str = "snapshot", gdn_kernels: bool | None = None):
        if max_len < 1:
            raise ValueError(f"a cache needs at least one slot, got max_len {max_len}")
        if mode not in VERIFY_MODES:
            raise ValueError(f"unknown hybrid verification mode {mode!r} (choose from {', '.join(VERIFY_MODES)})")
        n_attn = args.layer_types.count("full_attention")
        n_gdn = len(args.layer_types) - n_attn
        shape = (n_attn, max_len, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + \
            args.linear_num_value_heads * args.linear_value_head_dim
        self.state = torch.zeros(n_gdn, args.linear_num_value_heads, args.linear_key_head_dim,
                                 args.linear_value_head_dim, dtype=torch.float32, device=device)
        self.window = torch.zeros(n_gdn, args.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device)
        self.max_len, self.mode = max_len, mode
        if gdn_kernels is None:
            from specpilot.kernels.gdn_tree import triton

            dims = (args.linear_key_head_dim, args.linear_value_head_dim)
            gdn_kernels = torch.device(device).type == "cuda" and triton is not None and \
                all(d >= 16 and d & (d - 1) == 0 for d in dims)
        self.gdn_kernels = gdn_kernels
        self._records: dict[int, StaticRecord] = {}  # static buffers per row bucket (fixed addresses for graphs)
        self._bucket: int | None = None  # rows of the recorded static pass's bucket (None: an eager pass)
        self._length = 0
        self._pending: dict[int, tuple] = {}  # GDN layer -> (mixed [R, C], step inputs, {row: state})
        self._pass: tuple[int, int] | None = None  # (start, R) of the recorded exact pass
        self._path: list[int] | None = None  # accepted rows set by compact (None: rows 0, 1, ...)

    @property
    def length(self) -> int:
        """Committed tokens (read-only: see :meth:`commit`)."""
        return self._length

    # -- what an exact pass writes -----------------------------------------------------------------
    def begin_pass(self, start: int, r: int, bucket: int | None = None) -> None:
        """Start recording an exact pass of ``r`` rows at ``start`` (forgets any earlier record): an eager pass
        (``bucket`` None, recorded through :meth:`recorder`) or a static pass padded to ``bucket`` rows, which
        records into :meth:`static_record` ``(bucket)``.

        Raises:
            ValueError: ``start`` is not the committed length (a GDN pass runs from the committed state only).
        """
        if start != self._length:
            raise ValueError(f"a hybrid exact pass must start at the committed length {self._length}, got {start}")
        self._pending, self._pass, self._path, self._bucket = {}, (start, r), None, bucket

    def static_record(self, rows: int) -> StaticRecord:
        """The static buffers of a ``rows``-row bucket, allocated on first use and kept (a captured graph writes
        them at fixed addresses; a 27B-like target holds about 3.4 MB a row)."""
        from specpilot.model.hybrid_static import StaticRecord

        if rows not in self._records:
            layers, h, dk, dv = self.state.shape
            self._records[rows] = StaticRecord.empty(layers, rows, h, dk, dv, self.window.shape[2],
                                                     self.window.dtype, self.state.device)
        return self._records[rows]

    def keep_rows(self, r: int) -> range:
        """Rows of an ``r``-row exact pass whose GDN states the pass keeps for :meth:`commit`: every row in
        ``snapshot`` mode (a long prefill, over :attr:`SNAPSHOT_ROWS` rows, only its last), the last in ``replay``."""
        return range(r) if self.mode == "snapshot" and r <= self.SNAPSHOT_ROWS else range(r - 1, r)

    def recorder(self, layer: int):
        """The ``record`` callable of GDN layer ``layer`` for :meth:`GatedDeltaNet.forward`: keeps the conv inputs,
        the delta-rule inputs and the kept rows' states (:meth:`keep_rows`)."""
        def record(mixed, step_inputs, states):
            self._pending[layer] = (mixed, step_inputs, {j: states[j] for j in self.keep_rows(mixed.shape[0])})
        return record

    # -- the request loop's operations -------------------------------------------------------------
    def compact(self, start: int, rows: torch.Tensor) -> None:
        """Move an accepted path into place: K/V slots ``start + rows[j]`` to ``start + j``; the GDN layers follow
        the path at :meth:`commit`. ``rows [k] long`` increasing, the root (row 0) first. Length unchanged."""
        k = rows.numel()
        src = rows.to(self.k.device) + start
        self.k[:, start : start + k] = self.k[:, src]
        self.v[:, start : start + k] = self.v[:, src]
        self._path = rows.tolist()

    def commit(self, n: int) -> None:
        """Declare ``n`` tokens committed. ``n = 0`` frees the request (zero state and window). Otherwise ``n``
        must be the length or lie within the recorded pass: the GDN state and window move along the first
        ``n − start`` rows of the accepted path (module doc).

        Raises:
            ValueError: ``n`` outside ``[0, max_len]``, or an advance no recorded pass covers.
        """
        if not 0 <= n <= self.max_len:
            raise ValueError(f"cannot commit {n} slots of a cache of {self.max_len}")
        if n == 0:
            self.state.zero_()
            self.window.zero_()
            self._pending, self._pass, self._bucket, self._length = {}, None, None, 0
            return
        if n == self._length:
            return
        if self._pass is None or not self._pass[0] < n <= self._pass[0] + self._pass[1]:
            raise ValueError(f"cannot commit {n} tokens: no recorded pass from {self._length} covers them")
        start = self._pass[0]
        path = (self._path or list(range(self._pass[1])))[: n - start]
        if self._bucket is not None:  # a static pass: replay from its record
            from specpilot.model.hybrid_static import commit_path

            rows = torch.full((self._bucket,), -1, dtype=torch.int32)
            rows[: len(path)] = torch.tensor(path, dtype=torch.int32)
            commit_path(self.state, self.window, self._records[self._bucket], rows.to(self.state.device),
                        self.gdn_kernels)
            self._pass, self._path, self._bucket, self._length = None, None, None, n
            return
        for layer, (mixed, (q, k, v, g, beta), states) in self._pending.items():
            s = states.get(path[-1])
            if s is None:  # replay the accepted root path from the committed state
                s = self.state[layer]
                for j in path:
                    s = delta_step(s, q[j], k[j], v[j], g[j], beta[j])[0]
            self.state[layer] = s
            w = self.window.shape[1]
            self.window[layer] = torch.cat((self.window[layer], mixed[path].to(self.window.dtype)))[-w:] if w else \
                self.window[layer]
        self._pending, self._pass, self._path, self._length = {}, None, None, n

    def checkpoint(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A copy of the committed state (length, GDN states, conv windows) for :meth:`rollback`: a recurrent
        state cannot be moved back, so a draft model that drafts past its committed tokens (committing each
        drafted position to run the next) keeps one. Costs a copy of :attr:`state` and :attr:`window`."""
        return self._length, self.state.clone(), self.window.clone()

    def rollback(self, mark: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        """Restore the committed state :meth:`checkpoint` copied (K/V past its length become scratch again; any
        recorded pass is forgotten)."""
        n, state, window = mark
        self.state.copy_(state)
        self.window.copy_(window)
        self._pending, self._pass, self._path, self._bucket, self._length = {}, None, None, None, n

    def rewind(self, n: int) -> int:
        """Commit back to ``n`` tokens where the state allows it: ``n`` at or past the length keeps the length; an
        earlier ``n`` has no state to go back to (the recurrent state holds only the latest length), so the request
        restarts from 0 tokens (:meth:`commit` ``(0)``) and its caller re-runs them. Returns the length kept."""
        if n < self._length:
            self.commit(0)
        return self._length

    def nbytes(self) -> int:
        """Bytes held by the committed tensors (K/V, states, windows; not a pass's scratch)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.state, self.window))

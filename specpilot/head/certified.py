"""The certified INT8 LM head, ``lm_head_int8_certified`` (§4.1): the argmax of the exact head, found mostly
through an INT8 copy.

Reference. The exact head is the engine's ``Transformer.logits``: ``zhat = F.linear(h.to(W.dtype), W).float()``
over all R rows at once, and the answer is ``torch.argmax(zhat, -1)`` (ties: lowest index). :meth:`argmax`
returns exactly that. Note: a GEMM over a *subset* of W's rows does not in general give bit-identical values
(measured on CPU float32), so survivors cannot simply be rescored with a smaller GEMM and compared.

Build. Per vocab row v: ``s_v = max|W_v| / 127`` (float32; 1 for an all-zero row), ``q_v = round(W_v / s_v)``
int8 in [-127, 127]; float64 norms ``||W_v - s_v q_v||``, ``||q_v||``, ``||W_v||``.

Bound (per row r of h and vocab row v; z = <W_v, h> in real arithmetic, K = hidden size). A dot product
computed with inputs rounded with unit ``u_in``, any summation order with unit ``u_acc`` and a final
rounding ``u_out`` is off by at most ``eps * sum_k |x_k y_k|`` with
``eps = (1 + u_out)(1 + u_in)^2 (1 + gamma_K) - 1``, ``gamma_K = K u_acc / (1 - K u_acc)`` (Higham,
Accuracy and Stability, §3.1; any order, FMA or not; :mod:`specpilot.head.bound`), plus an absolute term ``eta = (K + 2) 2^-125`` for
flushed denormals (and 2^-24 for a float16 output). With ``sum |x y| <= ||x|| ||h||`` (Cauchy–Schwarz):

* approximate logit ``a_v = fl32(s_v * fl32(h . q_v))``:  ``|a_v - s_v <q_v, h>| <= eps_a s_v ||q_v|| ||h|| + eta``
  (u_out = 2^-24 for the scale multiply);
* quantization:  ``|<W_v - s_v q_v, h>| <= ||W_v - s_v q_v|| ||h||``;
* the engine's own rounding:  ``|zhat_v - z_v| <= eps_x ||W_v|| ||h|| + eta`` (u_out = 2^-8 bf16,
  2^-11 float16, 0 float32 output).

So ``zhat_v`` lies in ``[L_v, U_v] = a_v -/+ E_v``, ``E_v = ||h|| (||W_v - s_v q_v|| + eps_a s_v ||q_v|| +
eps_x ||W_v||) (1 + 1e-9) + 2 eta`` (the factor and outward ``nextafter`` cover the float64 evaluation).
A row with ``U_v < max_j L_j`` has ``zhat_v < zhat_j`` for some j: it is not the argmax, nor tied with it.

Rescoring. Survivors get ``z64 = h . W_v`` in float64 (products exact, sum error ``gamma_K(2^-53) A_v``,
``A_v = |h| . |W_v|``), which encloses the engine's float32 accumulator in ``z64 -/+ ((eps_acc + gamma64) A_v
+ eta)``; rounding the ends outward to float32 and then to the output dtype (monotone) encloses ``zhat_v``
in ``[Lo_v, Hi_v]``. If exactly one survivor has ``Hi >= max Lo``, or every such survivor is known exactly
(``Lo == Hi``, common with bf16 outputs), the argmax is decided (ties: lowest index). Otherwise (a near-tie
within rounding error) the row is *undecided* and the engine's full head is computed once for the call, as
the engine would, and its argmax used. Rows with non-finite h or a possible overflow take that path too.

Units assumed: ``u_acc = 2^-24`` on the CPU, ``2^-23`` on CUDA (tensor-core accumulators may truncate);
float32 matmuls at ``torch.get_float32_matmul_precision() == "highest"`` and without TF32 have
``u_in = 0``, otherwise ``u_in = 2^-8`` (covers TF32 and bf16 passes). bf16/fp16 GEMMs on CUDA must reduce
in float32 for ``u_acc`` to hold (cuBLAS may otherwise reduce split-K partials in the 16-bit type): the head runs
every exact-head GEMM of its own (:meth:`CertifiedInt8Head.exact_logits`, :meth:`CertifiedInt8Head.full_argmax`)
inside :func:`~specpilot.head.bound.fp32_reduction`, which turns
``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` off for that call only and restores
them, whatever the process set. So "the exact head" here is the float32-reducing one, which the engine's plain
head (``Transformer.logits``, run with the process's setting) equals unless the process allows reduced-precision
reductions and cuBLAS uses them.

This is the plain PyTorch reference; the INT8 product is done in float32 here (``q`` converted per call).
On the CPU (float32 heads, a oneDNN build) the first pass reads a prepacked bf16 copy of W instead
(:mod:`specpilot.head.cpu`: the CPU has no int8 GEMM at memory speed here; same certificate, a tighter bound).
On CUDA (bf16 / float32 heads, triton installed) :meth:`CertifiedInt8Head.argmax` runs the Triton path of
:mod:`specpilot.head.kernel` instead (same contract; no host sync but the one that checks the
per-row flags), and :meth:`CertifiedInt8Head.argmax_flagged` gives the sync-free form for CUDA graphs: the ids and,
explicitly, which rows need the full head.
:func:`with_int8_head` makes the engine mechanism ``lm_head_int8`` of a :class:`Transformer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specpilot.errors import SpecPilotError
from specpilot.head.bound import U_OUT, eps, fp32_reduction, gamma, matmul_units
from specpilot.head.cpu import Bf16FirstPass
from specpilot.head.cpu import applies as cpu_applies
from specpilot.head.kernel import Int8HeadKernel, triton

#: the Triton path serves up to this many rows per call; more rows (prefill chunks, wide passes) take the
#: full head, which is compute- rather than weight-read-bound there
KERNEL_MAX_ROWS = 64
_ROWS_CHUNK = 1 << 22


@dataclass
class HeadStats:
    """Counters over all :meth:`CertifiedInt8Head.argmax` calls (§4.1 certified head).

    Attributes:
        calls, rows: calls and rows of h seen.
        survivors: total survivors (vocab rows not discarded), summed over rows; ``last_survivors`` per row
            of the last call (LongTensor [R]).
        rescored: total union-of-survivor columns rescored (summed over calls).
        undecided_rows: rows settled by the engine's full head (near-ties within rounding, non-finite h,
            possible overflow); ``full_head_calls``: calls that computed it.
    """

    calls: int = 0
    rows: int = 0
    survivors: int = 0
    rescored: int = 0
    undecided_rows: int = 0
    full_head_calls: int = 0
    last_survivors: torch.Tensor | None = field(default=None, repr=False)


class CertifiedInt8Head:
    """Certified INT8 LM head (§4.1): exact greedy argmax of ``h @ W.T`` with an INT8 first pass.

    Args:
        weight: the head weight ``W [V, H]`` (float32, bfloat16 or float16; kept by reference, not copied).
        use_kernel: the Triton path (:class:`~specpilot.head.kernel.Int8HeadKernel`): None = on CUDA
            for bf16 / float32 weights when triton is installed; True forces it (tests: the interpreter on
            the CPU); False = this reference always.
        capacity: survivors per row kept by the Triton path (rows with more take the full head). Calls with
            more than ``KERNEL_MAX_ROWS`` (64) rows take the full head on the Triton path's devices.
        cpu_first_pass: the bf16 first pass (:class:`~specpilot.head.cpu.Bf16FirstPass`): None = for a float32
            head on the CPU where oneDNN packs; False = the INT8 reference always.
    Attributes:
        q: int8 ``[V, H]``; scale: float32 ``[V]`` (W ≈ scale[:, None] * q); built on first use (the CPU's bf16
            first pass reads only ``w_norm``, float64 ``[V]``).
        stats: :class:`HeadStats`.
    Raises:
        SpecPilotError: W not a 2-D floating tensor or holding inf/NaN (no bound exists).
    """

    def __init__(self, weight: torch.Tensor, use_kernel: bool | None = None, capacity: int = 32,
                 cpu_first_pass: bool | None = None):
        w = weight.detach()
        if w.dim() != 2 or w.dtype not in U_OUT:
            raise SpecPilotError(f"the LM head weight must be 2-D float32/bfloat16/float16, got {w.dtype} {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()):
            raise SpecPilotError("the LM head weight holds inf or NaN: no certified bound exists")
        self.weight = w
        step = max(1, _ROWS_CHUNK // max(w.shape[1], 1))
        self.w_norm = torch.cat([w[r0:r0 + step].double().norm(dim=1) for r0 in range(0, w.shape[0], step)])
        self._w_norm_max = float(self.w_norm.max())
        self._int8 = None  # (q, scale, res_norm, q_norm), built on first use: the bf16 CPU pass never reads it
        self.stats = HeadStats()
        self.use_kernel, self.capacity = use_kernel, capacity
        self._kernel = None
        self._cpu = None if cpu_first_pass is False or not cpu_applies(w) else Bf16FirstPass(w, self.w_norm)

    def _int8_copy(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, scale, res_norm, q_norm)``, quantized per vocab row on first use, in chunks of rows."""
        if self._int8 is None:
            w = self.weight
            v = w.shape[0]
            q_all = torch.empty_like(w, dtype=torch.int8)
            scale = torch.empty(v, dtype=torch.float32, device=w.device)
            res_norm, q_norm = (torch.empty(v, dtype=torch.float64, device=w.device) for _ in range(2))
            step = max(1, _ROWS_CHUNK // max(w.shape[1], 1))
            for r0 in range(0, v, step):
                wf = w[r0:r0 + step].float()
                amax = wf.abs().amax(1)
                s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
                q = torch.round(wf / s[:, None]).clamp_(-127, 127)
                w64, q64 = wf.double(), q.double()
                q_all[r0:r0 + step], scale[r0:r0 + step] = q.to(torch.int8), s
                res_norm[r0:r0 + step] = (w64 - s.double()[:, None] * q64).norm(dim=1)
                q_norm[r0:r0 + step] = q64.norm(dim=1)
            self._int8 = (q_all, scale, res_norm, q_norm)
        return self._int8

    @property
    def q(self) -> torch.Tensor:
        """int8 ``[V, H]``, the quantized head (built on first use)."""
        return self._int8_copy()[0]

    @property
    def scale(self) -> torch.Tensor:
        """float32 ``[V]``: ``W ≈ scale[:, None] * q``."""
        return self._int8_copy()[1]

    @property
    def res_norm(self) -> torch.Tensor:
        """float64 ``[V]``: ``||W_v - s_v q_v||``."""
        return self._int8_copy()[2]

    @property
    def q_norm(self) -> torch.Tensor:
        """float64 ``[V]``: ``||q_v||``."""
        return self._int8_copy()[3]

    def kernel(self):
        """The Triton path for this head (built on first use), or None when it does not apply here (see
        ``use_kernel``). Raises RuntimeError / ValueError when ``use_kernel=True`` and it cannot run."""
        if self.use_kernel is False:
            return None
        if self.use_kernel is None:
            if not (self.weight.is_cuda and triton is not None and self.weight.dtype in (torch.bfloat16, torch.float32)):
                return None
        if self._kernel is None:
            self._kernel = Int8HeadKernel(self, self.capacity)
        return self._kernel

    @torch.no_grad()
    def argmax_flagged(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sync-free certified argmax for CUDA graphs (§4.1): ``(ids [R] int64, needs_full_head [R] bool)``, both on
        h's device. Where ``needs_full_head`` is False, ``ids`` is the exact head's argmax of that row; where it is
        True (a near-tie within rounding, more survivors than the capacity, non-finite h or a possible overflow) the
        id is only a guess (a valid vocabulary id) and the caller must settle the row with the full head
        (:meth:`full_argmax` of the same h). No host sync on the Triton path (shapes depend only on R: capturable).
        Without the Triton path (see :meth:`kernel`) this is :meth:`argmax` (its own host sync) and no row is
        flagged; more than ``KERNEL_MAX_ROWS`` rows take :meth:`full_argmax`, none flagged.
        Raises SpecPilotError on a wrong h shape."""
        kern = self.kernel()
        if kern is None:
            ids = self.argmax(h)
            return ids, torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        self._check_h(h)
        if h.shape[0] > KERNEL_MAX_ROWS:
            ids = self.full_argmax(h)
            return ids, torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        ids, ok = kern(h)
        return ids, ~ok

    def _check_h(self, h: torch.Tensor) -> None:
        if h.dim() != 2 or h.shape[1] != self.weight.shape[1]:
            raise SpecPilotError(f"hidden states must be [R, {self.weight.shape[1]}], got {tuple(h.shape)}")

    def exact_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The exact head (§4.1 reference): ``h [R, H]`` -> ``F.linear(h.to(W.dtype), W).float()``, ``[R, V]``
        float32 logits, its GEMM reducing in float32 (:func:`~specpilot.head.bound.fp32_reduction`: the bound
        assumes a float32 accumulator; the process's cuBLAS flags are restored after the call)."""
        with fp32_reduction(self.weight.device):
            return F.linear(h.to(self.weight.dtype), self.weight).float()

    def full_argmax(self, h: torch.Tensor) -> torch.Tensor:
        """The full head's argmax ``[R] int64`` of ``h [R, H]`` (first index on ties): ``argmax`` of
        :meth:`exact_logits` (the same ids; computed on the logits in W's dtype, whose float32 cast is exact, without
        writing float32 logits), its GEMM reducing in float32. How a caller settles the rows
        :meth:`argmax_flagged` flags (also inside a CUDA-graph capture). Raises SpecPilotError on a wrong h shape."""
        self._check_h(h)
        with fp32_reduction(self.weight.device):
            return F.linear(h.to(self.weight.dtype), self.weight).argmax(dim=1)

    def _units(self) -> tuple[float, float]:
        """``(u_in, u_acc)`` of the exact head's GEMM on this device (:func:`~specpilot.head.bound.matmul_units`)."""
        return matmul_units(self.weight)

    def bounds(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """INT8 approximate logits and their certified error (§4.1): ``(a [R, V] float32, E [R, V] float64)``
        with ``|exact_logits(h) - a| <= E`` elementwise (logit units; for finite h without overflow).

        Args:
            h: ``[R, H]`` hidden states (cast to W's dtype first, as the engine's head does).
        Raises:
            SpecPilotError: a hidden size too large for a bound (``K · u_acc >= 1/2``).
        """
        he = h.to(self.weight.dtype)
        hf = he.float()
        k = self.weight.shape[1]
        u_in, u_acc = self._units()
        eps_a = eps(k, u_in, u_acc, 2.0**-24)
        eps_x = eps(k, u_in, u_acc, U_OUT[self.weight.dtype])
        eta = (k + 2) * 2.0**-125 + (2.0**-24 if self.weight.dtype == torch.float16 else 0.0)
        a = (hf @ self.q.to(torch.float32).T) * self.scale
        coef = self.res_norm + eps_a * self.scale.double() * self.q_norm + eps_x * self.w_norm
        e = hf.double().norm(dim=1, keepdim=True) * coef * (1 + 1e-9) + 2 * eta
        return a, e

    @property
    def cpu_first_pass(self) -> Bf16FirstPass | None:
        """The bf16 first pass :meth:`argmax` runs on the CPU (None: the INT8 reference)."""
        return self._cpu

    def _survivors(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cols [S] long, keep [R, S] bool)``: the vocab rows whose certified interval reaches the row's highest
        lower end, ascending, and which row keeps which (the INT8 reference in float64, or the CPU's bf16 first
        pass); a row with non-finite approximate logits keeps none."""
        if self._cpu is not None:
            u_in, u_acc = self._units()
            return self._cpu.survivors(h, eps(self.weight.shape[1], u_in, u_acc, 0.0))
        a, e = self.bounds(h)
        a64 = a.double()
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=self.weight.device)
        upper, lower = torch.nextafter(a64 + e, inf), torch.nextafter(a64 - e, -inf)
        keep = (upper >= lower.max(dim=1, keepdim=True).values) & torch.isfinite(a64).all(1, keepdim=True)
        cols = keep.any(0).nonzero().squeeze(1)
        return cols, keep[:, cols]

    @torch.no_grad()
    def argmax(self, h: torch.Tensor, full=None) -> torch.Tensor:
        """``torch.argmax(self.exact_logits(h), -1)`` for ``h [R, H]``, as LongTensor ``[R]`` (module docstring).

        Args:
            h: ``[R, H]`` hidden states.
            full: the engine's own head, ``h [R, H] -> ids [R] long``, for the rows the bound leaves undecided (a
                near-tie within rounding takes the argmax of the GEMM the engine runs, so that its outputs equal
                the plain engine's); None: :meth:`exact_logits`.
        Raises:
            SpecPilotError: h of the wrong shape.
        """
        w = self.weight
        self._check_h(h)
        h = h.to(w.device)
        r = h.shape[0]
        kern = self.kernel()
        if kern is not None and r > KERNEL_MAX_ROWS:  # many rows (a prefill): the full head, as the engine's
            self.stats.calls, self.stats.rows = self.stats.calls + 1, self.stats.rows + r
            self.stats.full_head_calls += 1
            return self.exact_logits(h).argmax(dim=1)
        if kern is not None:
            return self._argmax_kernel(kern, h, full)
        cols, sub = self._survivors(h)
        hn = h.to(w.dtype).double().norm(dim=1)
        limit = torch.finfo(w.dtype).max / 4
        bad = ~torch.isfinite(hn) | (hn * self._w_norm_max >= limit) | ~sub.any(1)  # non-finite: nothing kept
        sub &= ~bad[:, None]
        out = torch.zeros(r, dtype=torch.long, device=w.device)
        undecided = bad.clone()
        if cols.numel():
            lo, hi = self._enclose(h, cols)
            ninf = torch.tensor(float("-inf"), device=w.device)
            lo, hi = torch.where(sub, lo, ninf), torch.where(sub, hi, ninf)
            m = lo.max(dim=1, keepdim=True).values
            cand = hi >= m
            decided = (cand.sum(1) == 1) | ((lo == hi) | ~cand).all(1)
            out = cols[torch.where(cand, lo, ninf).argmax(dim=1)]  # first maximum = lowest vocab index
            undecided |= ~decided
        if bool(undecided.any()):
            ids = full(h) if full is not None else self.exact_logits(h).argmax(dim=1)
            out = torch.where(undecided, ids, out)
            self.stats.full_head_calls += 1
        st = self.stats
        st.last_survivors = sub.sum(1)
        st.calls, st.rows = st.calls + 1, st.rows + r
        st.survivors += int(st.last_survivors.sum())
        st.rescored += int(cols.numel())
        st.undecided_rows += int(undecided.sum())
        return out

    def _argmax_kernel(self, kern, h: torch.Tensor, full=None) -> torch.Tensor:
        """:meth:`argmax` through the Triton path: its flagged rows take the full head (one host sync).
        Stats: calls, rows, undecided_rows (flagged rows), full_head_calls; survivors are not counted here
        (``kern.last_survivors`` holds the device counts)."""
        tok, ok = kern(h)
        st = self.stats
        st.calls, st.rows = st.calls + 1, st.rows + h.shape[0]
        bad = int((~ok).sum())
        if bad:
            tok = torch.where(ok, tok, full(h) if full is not None else self.exact_logits(h).argmax(dim=1))
            st.undecided_rows += bad
            st.full_head_calls += 1
        return tok

    def _enclose(self, h: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Lo, Hi) [R, S]`` float32 with ``Lo <= exact_logits(h)[:, cols] <= Hi`` (float64 rescoring)."""
        w = self.weight
        k = w.shape[1]
        u_in, u_acc = self._units()
        h64 = h.to(w.dtype).double()
        w64 = w[cols].double()
        z = h64 @ w64.T
        amag = h64.abs() @ w64.abs().T
        delta = (eps(k, u_in, u_acc, 0.0) + gamma(k, 2.0**-53) + 1e-9) * amag + (k + 2) * 2.0**-125
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=w.device)
        lo64, hi64 = torch.nextafter(z - delta, -inf), torch.nextafter(z + delta, inf)
        lo, hi = lo64.float(), hi64.float()
        lo = torch.where(lo.double() > lo64, torch.nextafter(lo, torch.tensor(float("-inf"), device=w.device)), lo)
        hi = torch.where(hi.double() < hi64, torch.nextafter(hi, torch.tensor(float("inf"), device=w.device)), hi)
        if w.dtype != torch.float32:  # the engine rounds its float32 accumulator to W's dtype (monotone)
            lo, hi = lo.to(w.dtype).float(), hi.to(w.dtype).float()
        return lo, hi


def with_int8_head(model, head: CertifiedInt8Head | None = None):
    """The engine mechanism ``lm_head_int8`` (§4.1): a shallow copy of the :class:`Transformer` ``model``
    (every parameter, buffer and child shared; ``model`` itself unchanged) whose greedy argmax
    (``Transformer.greedy``: AR steps, verify passes, prefill) goes through a :class:`CertifiedInt8Head` of
    its LM head weight. The argmax is the full head's, so outputs do not change (in float32 on the CPU,
    speculative == AR token for token, as without the mechanism).

    Args:
        model: a Transformer (plain or W12) whose LM head is a plain ``nn.Linear`` (a W12 head, from
            :func:`~specpilot.w12.convert.to_w12`, must first be swapped back for the bf16 head: the
            certified head rescores from those exact weights; :meth:`Deployment.int8_target` does that).
        head: a head built on ``model.lm_head.weight`` to share between copies (None: build one, which
            quantizes the head: one pass over V x H weights).
    Returns: the new model object.
    Raises:
        SpecPilotError: ``head`` was built on another weight, the LM head is not a plain linear layer (a W12
            head), or the weight holds inf / NaN.
    """
    import copy

    if not hasattr(model.lm_head, "weight"):
        raise SpecPilotError(f"the certified INT8 head needs the bf16 LM head; this model's head is a "
                             f"{type(model.lm_head).__name__} (a W12 head: build the INT8 head on the plain target's)")
    if head is None:
        head = CertifiedInt8Head(model.lm_head.weight)
    elif head.weight.data_ptr() != model.lm_head.weight.data_ptr() or head.weight.shape != model.lm_head.weight.shape:
        raise SpecPilotError("the certified INT8 head was built on another LM head weight")
    out = copy.copy(model)
    out._modules = dict(model._modules)
    out.int8_head = head
    return out


__all__ = ["CertifiedInt8Head", "HeadStats", "with_int8_head"]

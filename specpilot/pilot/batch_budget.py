"""Per-batch-size node budgets for the shared budget (§4.4): the flat region of the target's batched pass.

In batching every verified row costs, but not every row costs the same: while the pass is bound by streaming the
weights, rows added to it are nearly free, and past some total they are not (§2.2). A step over ``n`` requests
carries ``n`` rows anyway (each request's root, AR's step); the shared budget of that step is the drafted rows it
can add before the pass gets dearer. This module measures the batched pass by total rows at each batch size,
untimed (outside every batch run), and picks that edge:

- :func:`measure_pass_ms`: median ms of one batched exact pass of ``m`` requests over ``m`` pool slots, each with
  ``PREFIX`` committed positions, the rows spread evenly over the requests, causal among a request's rows, + the
  batched greedy head and the host read, by total rows, each total timed interleaved with the ``m``-row pass it is
  compared to; the pass a ``shared_budget`` engine runs: where the engine pads its passes (CUDA,
  :func:`~specpilot.engine.batch_runner.runs_padded`) the :class:`~specpilot.engine.batch_runner.BatchRunner`'s
  bucketed CUDA graph, padding included, else ``Transformer.forward_batch`` eagerly. Ascending, it stops after two
  totals in a row past the flat region.
- :func:`flat_budget`: the edge of the flat region, the last measured total ``R`` (from ``m`` up) that costs at most
  ``1 + FLAT_TOLERANCE`` times the ``m``-row pass before two totals in a row cost more; the budget is ``R - m``
  drafted nodes (roots excluded), at least 1 (a pass that is not flat at all still verifies one drafted node: the
  shared budget's smallest step). Why two: the pass's cost never falls as rows are added (or falls only where a
  wider kernel happens to be faster), so a single dearer total followed by a flat one is the machine's noise, not the
  edge. On a shared 2-core CPU one total 6% over the 8-row pass (9 rows) once ended the region at one node, where a
  hand-set 8-node budget ran 7% faster than AR in the same process.
- :func:`shared_budgets`: the ``SystemConfig.shared_budget`` tuple, entry ``m - 1`` for every ``m`` in
  ``1..max_size`` (steps over fewer requests than the batch's slots happen at its tail).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from specpilot.engine.batch_runner import BatchRunner, runs_padded
from specpilot.model.batch import BatchRows

FLAT_TOLERANCE = 0.05  # "within a few percent": a pass at most 5% dearer than the m-row pass is flat
EXTRA_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # drafted rows tried on top of the m roots (the budget's grid)
PREFIX = 128  # committed positions per request in the measured pass (a benchmark prompt's order of length)
REPEATS = 7  # timed passes per total (median), after 2 warm-up passes


def _device_sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.inference_mode()
def measure_pass_ms(target, m: int, extras=EXTRA_ROWS, tolerance: float = FLAT_TOLERANCE, prefix: int = PREFIX,
                    repeats: int = REPEATS, stack=None, worth: dict[int, float] | None = None,
                    _clock=time.perf_counter) -> dict[int, float]:
    """Ms of one batched exact pass of ``m`` requests by total rows (module doc), ``{m: ms, m + e: ms, ...}`` for
    ``e`` in ``extras`` ascending, stopping after two totals in a row whose cost passes ``1 + tolerance`` times the
    ``m``-row pass's (the totals past them are outside the flat region whatever they cost: :func:`flat_budget`), or,
    given ``worth`` (``e`` -> the most ``m + e`` rows may cost relative to ``m`` and still pay:
    :func:`~specpilot.pilot.batch_budget_replay.break_even`), past the larger of the two bounds.

    Each ``m + e`` is timed in ``repeats`` rounds interleaved with the ``m``-row pass; its figure is the ``m``-row
    median of the whole run times the ratio of the two medians of its own rounds, so drift between totals cancels.

    Args:
        target: a :class:`~specpilot.model.transformer.Transformer` (its ``new_pool``, ``forward_batch``,
            ``batch_greedy``). m: requests in the pass (>= 1). prefix: committed positions per request (less when
            the target's context is shorter than it and the rows). stack: the target's
            :class:`~specpilot.model.compiled_stack.CompiledStack` when the engines run it (``compile_cpu``).
    Raises:
        ValueError: ``m < 1``, ``repeats < 1``, or rows that leave no prefix in the target's context.
    """
    if m < 1 or repeats < 1:
        raise ValueError(f"a pass has at least one request and one repeat, got m={m}, repeats={repeats}")
    extras = sorted(set(int(e) for e in extras if e >= 1))
    dev = target.device
    most = -(-(m + (extras[-1] if extras else 0)) // m)  # rows of the fullest request at the largest total
    prefix = min(prefix, target.args.max_position_embeddings - most - 1)  # a short context: a shorter prefix
    if prefix < 1:
        raise ValueError(f"{most} rows per request leave no prefix in the target's "
                         f"{target.args.max_position_embeddings} positions")
    pool = target.new_pool(m + 1, prefix + most + 1)  # slot m: the scratch slot a padded pass's padding writes to
    runner = BatchRunner(target, pool, m, most) if runs_padded(target, pool) else None
    fwd = (stack or target).forward_batch  # the pass the engines run
    fwd(torch.zeros(m * prefix, dtype=torch.long, device=dev),
                         torch.arange(prefix, device=dev).repeat(m), pool,
                         BatchRows(list(range(m)), [0] * m, [prefix] * m, [None] * m))
    for s in range(m):  # the prefix committed, as the engine's prefill leaves it
        pool.cache(s).commit(prefix)

    def make(total: int):
        counts = [total // m + (i < total % m) for i in range(m)]
        toks = torch.tensor([(7 * i) % target.args.vocab_size for i in range(total)], device=dev)
        pos = torch.tensor([prefix + j for c in counts for j in range(c)], device=dev)
        kernel = True if runner is not None else target.kernels.batch_kernel  # the engine's choice
        tok_rows = [toks[sum(counts[:i]):sum(counts[:i + 1])].tolist() for i in range(m)]
        pos_rows = [list(range(prefix, prefix + c)) for c in counts]

        def one() -> float:
            _device_sync(dev)
            t0 = _clock()
            got = None if runner is None else runner.run(list(range(m)), [prefix] * m, tok_rows, pos_rows, [None] * m)
            if got is not None:  # the bucketed graph (None: past the largest bucket, the engine's eager pass)
                got[0].tolist()
            else:
                rows = BatchRows(list(range(m)), [prefix] * m, counts, [None] * m)  # prepared per pass, as the engine
                target.batch_greedy(fwd(toks, pos, pool, rows, kernel=kernel), kernel).tolist()
            _device_sync(dev)
            return 1e3 * (_clock() - t0)
        return one

    base = make(m)
    for _ in range(2):
        base()
    base_all: list[float] = []
    out = {}
    over = 0  # totals in a row past the flat region
    for e in extras:
        one = make(m + e)
        for _ in range(2):
            one()
        b, t = [], []
        for _ in range(repeats):
            b.append(base())
            t.append(one())
        base_all += b
        out[m + e] = sorted(t)[len(t) // 2] / max(sorted(b)[len(b) // 2], 1e-9)  # a ratio for now
        bound = max(1 + tolerance, (worth or {}).get(e, 0.0))
        over = over + 1 if out[m + e] > bound else 0
        if over == 2:
            break
    if not base_all:  # no extras: the m-row pass alone
        base_all = [base() for _ in range(repeats)]
    base_ms = sorted(base_all)[len(base_all) // 2]
    return {m: base_ms, **{r: x * base_ms for r, x in out.items()}}


def flat_budget(costs: dict[int, float], m: int, tolerance: float = FLAT_TOLERANCE) -> int:
    """Drafted nodes a step over ``m`` requests may verify inside the flat region (module doc): ``R - m`` for the
    last total ``R`` of ``costs`` (total rows -> ms, ``m`` among them), ascending from ``m``, that costs at most
    ``(1 + tolerance) * costs[m]`` before two totals in a row cost more (one dearer total between flat ones is
    noise; the last measured total dearer counts as two); at least 1.

    Raises:
        ValueError: ``costs`` lacks the ``m``-row pass, holds a total below ``m``, or a cost <= 0.
    """
    if m not in costs:
        raise ValueError(f"the cost table has no {m}-row pass to compare with")
    if min(costs) < m or min(costs.values()) <= 0:
        raise ValueError(f"a pass of {m} requests has at least {m} rows and costs more than 0 ms")
    totals = sorted(t for t in costs if t >= m)
    edge = m
    for i, total in enumerate(totals):
        if costs[total] <= (1 + tolerance) * costs[m]:
            edge = total
        elif i + 1 == len(totals) or costs[totals[i + 1]] > (1 + tolerance) * costs[m]:
            break
    return max(edge - m, 1)


def shared_budgets(max_size: int, pass_ms: Callable[[int], dict[int, float]],
                   tolerance: float = FLAT_TOLERANCE) -> tuple[tuple[int, ...], dict[int, dict[int, float]]]:
    """The per-size budgets ``(budget for 1 request, ..., for max_size)`` (``SystemConfig.shared_budget``) and the
    cost tables they came from, ``{m: {total rows: ms}}``; ``pass_ms(m)`` measures one table
    (:func:`measure_pass_ms` on the deployment's target). Raises ValueError: ``max_size < 1``."""
    if max_size < 1:
        raise ValueError(f"budgets for at least one batch size, got {max_size}")
    tables = {m: pass_ms(m) for m in range(1, max_size + 1)}
    return tuple(flat_budget(tables[m], m, tolerance) for m in range(1, max_size + 1)), tables

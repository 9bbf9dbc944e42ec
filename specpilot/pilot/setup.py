"""Pilot setup helpers: the request set, the torch thread count, exact-pass timing by rows."""

from __future__ import annotations

import os
import time

import torch

from specpilot.data.benchmarks import load_mix
from specpilot.errors import SpecPilotError
from specpilot.pilot.controller import Req


BYTE_ID_OFFSET = 256  # byte b of a prompt becomes token id 256 + b when the target has no tokenizer


def build_requests(dep, per_benchmark: int, max_new_tokens: int, prompts=None) -> list[Req]:
    """The pilot's request set: the first ``per_benchmark`` prompts of every bundled benchmark, or with ``prompts``
    (a path: ``--prompts FILE``) of every group of that file of the deployment's own requests
    (:func:`~specpilot.pilot.request_file.load_request_file`, which raises SpecPilotError for a bad file).

    MT-Bench goes through the tokenizer's chat template when it has one. Prompts are tokenized without
    special tokens; requests whose prompt would not fit the context are skipped. A target without a
    tokenizer (``dep.tokenizer`` None: random-weight checkpoints for timing) gets each prompt's UTF-8 bytes
    as ids ``BYTE_ID_OFFSET + byte``: distinct, repeatable prompts of text-like structure, nothing more.

    Raises:
        SpecPilotError: no tokenizer and a vocabulary too small for byte ids (< 512).
    """
    tok = dep.tokenizer
    vocab = dep.target.args.vocab_size
    limit = min(dep.target.args.max_position_embeddings, 4096) - max_new_tokens
    if prompts is not None:  # a text prompt's byte ids outside a small vocabulary: the file's own one-line error
        from specpilot.pilot.request_file import load_request_file

        got = load_request_file(prompts, tok, vocab, max_new_tokens, BYTE_ID_OFFSET)
        return [r for r in got if r.index < per_benchmark and len(r.prompt_ids) <= limit]
    if tok is None and vocab < BYTE_ID_OFFSET + 256:
        raise SpecPilotError(f"{dep.target_dir} has no tokenizer and a vocabulary of {vocab} ids, too small to feed "
                             f"the prompts as byte ids (needs {BYTE_ID_OFFSET + 256})")
    reqs = []
    for r in load_mix(per_benchmark, tokenizer=tok):
        if tok is None:
            ids = [BYTE_ID_OFFSET + b for b in r.text.encode("utf-8")]
        else:
            ids = tok(r.text, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= limit:
            reqs.append(Req(r.benchmark, r.index, tuple(ids), max_new_tokens))
    return reqs


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(device: str, requested: int | None, cores: int, default: int) -> tuple[int, str]:
    """torch intra-op threads for the pilot and why (recorded in the report).

    On a CPU device with at most 2 cores the pilot pins 1 thread: with 2 threads on a shared 2-core
    machine a paired run was about 5x slower (docs/NOTES.md). ``requested`` (``--threads``) overrides.

    Args:
        device: torch device string of the deployment. requested: ``--threads`` or None.
        cores: available CPU cores. default: torch's current thread count.
    Returns:
        ``(threads, reason)``.
    Raises:
        ValueError: ``requested < 1``.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested, "--threads"
    if device.split(":")[0] == "cpu" and cores <= 2:
        return 1, f"pinned to 1 on a CPU device with {cores} core(s)"
    return default, "torch default"


@torch.inference_mode()
def measure_verify_ms(model, prefix_len: int, rows=(1, 2, 4, 8, 16, 32), repeats: int = 12,
                      static: bool = False, feature_layers: tuple[int, ...] = ()) -> dict[int, float]:
    """Median ms of one exact pass (forward + LM head + argmax + host read) by row count (c(N) curve, §3.2),
    timed in ``repeats`` interleaved rounds after 3 warm-up passes per row count.

    Rows attend to ``prefix_len`` committed slots and causally among themselves. ``static=False`` times the
    dynamic path the CPU engine uses; ``static=True`` the row-bucket path (CUDA graphs on CUDA), as the
    engine runs with ``buckets=True``. ``feature_layers``: the pass also gathers the outputs of these target
    layers into one ``[rows, len(layers) * hidden]`` tensor, as the engine's pass does for a drafter that reads
    target features (a block drafter, §1.1); ``()``: none, AR's pass.
    """
    from specpilot.engine.runner import BUCKETS, BucketRunner

    dev = model.device
    cache = model.new_cache(prefix_len + max(*rows, BUCKETS[-1]) + 1)
    model.forward(torch.zeros(prefix_len, dtype=torch.long, device=dev), torch.arange(prefix_len, device=dev), cache, 0)
    cache.commit(prefix_len)  # the timed passes start at the committed length, as the engine's (a hybrid's must)
    # the engine's buckets: a row count between buckets is timed padded, as the engine runs it
    runner = BucketRunner(model, cache, BUCKETS, graphs=True, feature_layers=tuple(feature_layers)) if static else None
    passes = {}
    for r in rows:
        tok_list, pos_list = [i % model.args.vocab_size for i in range(r)], list(range(prefix_len, prefix_len + r))
        toks, pos = torch.tensor(tok_list, device=dev), torch.tensor(pos_list, device=dev)
        mask = torch.ones(r, prefix_len + r, dtype=torch.bool, device=dev)
        mask[:, prefix_len:] = torch.ones(r, r, dtype=torch.bool, device=dev).tril()

        def one_pass(tok_list=tok_list, pos_list=pos_list, toks=toks, pos=pos, mask=mask):
            if runner is not None:
                return runner.run(tok_list, pos_list, prefix_len, None).tolist()
            feats: list = []
            hidden = model.forward(toks, pos, cache, prefix_len, mask, features=feats, feature_layers=feature_layers)
            if feats:  # as Engine._argmax keeps them for the drafter
                torch.cat(feats, dim=-1)
            return model.logits(hidden).argmax(-1).tolist()

        for _ in range(3):  # warm-up (graph capture)
            one_pass()
        passes[r] = one_pass
    # interleaved rounds (every row count once per round), so drift in clocks or load hits all alike
    times = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            passes[r]()
            times[r].append(1e3 * (time.perf_counter() - t0))
    out = {r: sorted(t)[len(t) // 2] for r, t in times.items()}
    return out


def measure_move_ms(model, prefix_len: int, lengths=(2, 3, 5, 9, 17), repeats: int = 12,
                    feature_layers: tuple[int, ...] = ()) -> dict[int, float]:
    """Ms to move an accepted path of ``k`` rows into place, by ``k`` (root included, ``k ≥ 2``), as a speculative
    step does when its path is not the tree's rows ``0 … k−1`` (§1.1, R8; ``Engine._step``): the path's row indices
    to a tensor, the target cache's compaction (:meth:`KVCache.compact` at ``prefix_len``) and, with
    ``feature_layers``, the gather of the path's rows of the pass's features ``[rows, len(layers) * hidden]`` that
    the engine hands a drafter reading them. The path timed is rows ``0, 2, 4, …``.

    On the CPU each move is timed alone (median of ``repeats`` interleaved rounds after one warm-up per length). On
    CUDA the engine never waits for a move (its kernels queue behind the pass and run while the host drafts the next
    step), so a move costs what it holds up the stream or the host: ``repeats`` moves are queued back to back and the
    time to the one sync after them, divided by ``repeats``, is the figure (per length, the median of 3 such runs);
    a sync after each move would count the device's round trip, about a whole step of a launch-bound target.

    Raises:
        ValueError: a length below 2 (a one-row path, the root alone, is always in place).
    """
    if min(lengths) < 2:
        raise ValueError(f"a moved path has at least 2 rows, got lengths {tuple(lengths)}")
    dev = model.device
    span = 2 * max(lengths)
    cache = model.new_cache(prefix_len + span)
    width = len(feature_layers) * model.args.hidden_size
    feats = torch.zeros(span, width, dtype=model.dtype, device=dev) if feature_layers else None
    cuda = dev.type == "cuda"

    def move(k: int) -> None:
        rows = torch.tensor([0] + [2 * j for j in range(1, k)])
        cache.compact(prefix_len, rows)
        if feats is not None:
            feats[rows.to(dev)]

    def timed(k: int, n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            move(k)
        if cuda:
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / n

    for k in lengths:
        timed(k, 1)
    times = {k: [] for k in lengths}
    for _ in range(3 if cuda else repeats):
        for k in lengths:
            times[k].append(timed(k, repeats if cuda else 1))
    return {k: sorted(t)[len(t) // 2] for k, t in times.items()}

"""CUDA-graph timing helpers of the GPU suites (and of the scripts in ``probes/``)."""

import torch


def time_graph(calls) -> float:
    """µs per call of the zero-argument callables ``calls``, replayed from one CUDA graph of all of them
    (CUDA events, best of 5 replays). The first two are run once eagerly first (compiles, cuBLAS handles), on
    the stream the graph is then captured on (per-stream state such as W12's ``fused_split`` counters exists
    before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for c in calls:
            c()
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / len(calls))
    del g
    return best


def time_calls(fn, weights, x, reps=10) -> float:
    """µs per call of ``fn(x, w)`` cycling ``weights``, replayed from one CUDA graph (best of 5 replays).

    Cycling through weight copies larger than L2 (the callers use ≥ 512 MiB) makes every call read its
    weights from HBM, as in a real pass where every layer's weights are distinct."""
    return time_graph([lambda w=w: fn(x, w) for _ in range(reps) for w in weights])

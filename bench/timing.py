"""Timing helper shared by the GPU bench scripts (run as ``python bench/<script>.py``; imported by name)."""

import torch


def time_calls(fn, weights, x, reps=10) -> float:
    """µs per call of ``fn(x, w)`` cycling ``weights``, replayed from one CUDA graph (best of 5 replays).

    Cycling through weight copies larger than L2 (the callers use ≥ 512 MiB) makes every call read its
    weights from HBM, as in a real pass where every layer's weights are distinct."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for w in weights:
                fn(x, w)
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / (reps * len(weights)))
    del g
    return best

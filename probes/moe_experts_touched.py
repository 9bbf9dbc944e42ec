"""How many routed experts R rows of one verification pass touch, and the CPU time of the reference MoE block by R.

A random-weight qwen3_next (the Qwen3-Next-80B-A3B routing shape: 512 experts, top 10, a shared expert; hidden and
widths shrunk) runs a prompt of random tokens; each MoE layer's input rows are cut into windows of R consecutive
rows (the rows of a chain pass), and the distinct experts each window picks are counted. Beside it: what
independent uniform routing gives, ``E (1 − (1 − k/E)^R)``. Random routers route near-uniformly and independently;
a trained router is skewed and correlated across neighbouring tokens, so this is the high end, not a forecast.
Then the CPU time of one SparseMoE forward (float32, one thread) at R rows, the reference loop (one GEMM triple
per touched expert). CPU; run from the repository root: ``python probes/moe_experts_touched.py OUT.json``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

from specpilot.model.moe import SparseMoE
from specpilot.zoo.random_ckpt import random_transformer

ROWS = (1, 2, 4, 8, 16, 32, 64)


def touched(seed: int = 0, prompt: int = 512) -> dict:
    over = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": 1024, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16, "intermediate_size": 64}
    m = random_transformer("qwen3-next-80b-a3b-like", device="cpu", dtype=torch.float32, seed=seed, overrides=over)
    inputs = []
    for layer in m.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.register_forward_pre_hook(lambda mod, a: inputs.append((mod, a[0].detach())))
    ids = torch.randint(0, 1024, (prompt,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        m(ids, torch.arange(prompt), m.new_cache(prompt), 0)
    e, k = m.args.num_experts, m.args.num_experts_per_tok
    out = {"num_experts": e, "top_k": k, "moe_layers": len(inputs), "prompt_rows": prompt, "by_rows": {}}
    for r in ROWS:
        counts = [mod.experts_touched(x[i : i + r]) for mod, x in inputs for i in range(0, prompt - r + 1, r)]
        out["by_rows"][r] = {"mean_experts": statistics.mean(counts), "min": min(counts), "max": max(counts),
                             "fraction": statistics.mean(counts) / e, "windows": len(counts),
                             "uniform_independent": e * (1 - (1 - k / e) ** r)}
    return out


def block_time(reps: int = 7) -> dict:
    torch.set_num_threads(1)
    over = {"hidden_size": 512, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
            "num_hidden_layers": 1, "layer_types": ["full_attention"], "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 64}
    m = random_transformer("qwen3-next-80b-a3b-like", device="cpu", dtype=torch.float32, overrides=over)
    moe = m.model.layers[0].mlp
    out = {"hidden": 512, "moe_intermediate": 128, "threads": 1, "reps": reps, "by_rows": {}}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in ROWS:
            x = torch.randn(r, 512, generator=gen)
            moe(x)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                moe(x)
                ts.append(time.perf_counter() - t0)
            out["by_rows"][r] = {"median_ms": 1e3 * statistics.median(ts), "experts": moe.experts_touched(x)}
    return out


def main(path: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"commit": commit, "torch": torch.__version__, "device": "cpu", "touched": touched(),
           "block_time": block_time(), "command": "python probes/moe_experts_touched.py " + path}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for r in ROWS:
        t, b = res["touched"]["by_rows"][r], res["block_time"]["by_rows"][r]
        print(f"R={r:3d}  experts {t['mean_experts']:6.1f} ({100 * t['fraction']:5.1f}%)  uniform "
              f"{t['uniform_independent']:6.1f}  block {b['median_ms']:7.2f} ms ({b['experts']} experts)")


if __name__ == "__main__":
    main(sys.argv[1])

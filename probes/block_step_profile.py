"""Where a graphed block-drafter step's GPU time goes (random Qwen3-8B shape, bf16): the static step's kernels
(torch profiler over the eager static body) and CUDA-graph timings of its pieces. Usage: python3 probes/block_step_profile.py OUT.json"""

import json
import sys

import torch

from specpilot.bench.timing import time_graph
from specpilot.provenance import git_commit
from specpilot.spec.block import BlockDrafter
from specpilot.spec.cost_drafter import cost_drafter
from specpilot.zoo.random_ckpt import random_transformer

dev = torch.device("cuda")
target = random_transformer("qwen3-8b", dev)
res = {"commit": git_commit(), "device": torch.cuda.get_device_name()}
for rank in (0, 16):
    net = cost_drafter({"kind": "block", "layers": 1, "block_size": 16, "markov_rank": rank, "n_target_layers": 3},
                       target, 16).net
    for max_len in (4096, 1024):
        d = BlockDrafter(net, target, 16, max_len=max_len, static_step=True)
        step = d._step
        step.graphs = False
        step.host_io[:] = torch.tensor([5, 600, 601])
        step.io.copy_(step.host_io)
        with torch.inference_mode():
            w = step.width(601)
            us = time_graph([lambda: step._body(w)] * 10)
            res[f"rank{rank}_S{max_len}_body_us"] = us
            print(rank, max_len, "body", us, flush=True)
            if rank == 0 and max_len == 4096:
                from torch.profiler import ProfilerActivity, profile
                for _ in range(3):
                    step._body(w)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step._body(w)
                    torch.cuda.synchronize()
                rows = sorted(((e.key, e.device_time_total / 10, e.count // 10) for e in prof.key_averages()),
                              key=lambda r: -r[1])
                res["kernels_us_per_step"] = [{"kernel": k[:120], "us": round(t, 2), "calls": c} for k, t, c in rows[:30]]
                for r in rows[:30]:
                    print(f"{r[1]:9.1f} us  x{r[2]}  {r[0][:110]}")
                h = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
                res["lm_head_16rows_us"] = time_graph([lambda: target.logits(h)] * 10)
                lg = target.logits(h)
                res["logsoftmax_topk_us"] = time_graph([lambda: lg.log_softmax(-1).topk(16, dim=-1)] * 10)
                res["topk_only_us"] = time_graph([lambda: lg.topk(16, dim=-1)] * 10)
                sub = target.lm_head.weight[:32768].contiguous()
                res["lm_head_32k_vocab_16rows_us"] = time_graph([lambda: torch.nn.functional.linear(h, sub).float()] * 10)
                print({k: v for k, v in res.items() if k.endswith("_us")}, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=2)

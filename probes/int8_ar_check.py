"""Pipelined AR with the certified INT8 head on the GPU: same tokens as plain AR, and tokens/s of
both, on the bundled target (trained: peaked logits, few flags) and on random Qwen3-8B weights (near-uniform
logits: most steps flagged, so the redo path runs on nearly every step).

    python probes/int8_ar_check.py OUT.json [QWEN3_8B_DIR]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.provenance import git_commit, versions
from specpilot.zoo import bundled_target_dir


def check(target_dir, n_prompts: int, new: int, dtype="bfloat16") -> dict:
    dep = Deployment(target_dir, None, dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, dep.target.args.vocab_size - 10, (64,), generator=g).tolist() for _ in range(n_prompts)]
    out = {}
    for name, cfg in (("ar", SystemConfig.ar(dtype=dtype)), ("ar_int8head", SystemConfig.ar(dtype=dtype, lm_head_int8=True))):
        eng = dep.system(cfg)
        eng.generate(prompts[0], 8)  # warm-up (graph capture)
        toks, dec_s, steps = [], 0.0, 0
        for p in prompts:
            gen = eng.generate(p, new)
            toks.append(list(gen.tokens))
            dec_s += gen.time_s - gen.prefill_s
            steps += gen.steps
        head = getattr(eng.target, "int8_head", None)
        out[name] = {"tokens": toks, "decode_tokens_per_s": steps / dec_s, "ms_per_step": 1e3 * dec_s / steps,
                     "pipelined": eng._pipelined_ar(None)}
        if head is not None and hasattr(head, "stats"):
            out[name]["head_calls"] = head.stats.calls
    out["equal"] = out["ar"]["tokens"] == out["ar_int8head"]["tokens"]
    out["speedup"] = out["ar_int8head"]["decode_tokens_per_s"] / out["ar"]["decode_tokens_per_s"]
    print(target_dir, {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "tokens"})
                       for k, v in out.items()}, flush=True)
    return out


def main():
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "t0": time.time()}
    res["bundled"] = check(bundled_target_dir(), 8, 64)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
    if len(sys.argv) > 2:
        res["qwen3_8b_random"] = check(sys.argv[2], 2, 32)
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()

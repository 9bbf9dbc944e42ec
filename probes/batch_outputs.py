"""The batched engine's greedy outputs on SmolLM2 (float32, CPU) for the peer probe's 8 chat prompts, AR and the sealed
n-gram system at several slot counts (1 slot: 3 verified rows a step; 2-3 AR slots: 2-3 rows), dumped to compare two
source trees token for token (run it with ``PYTHONPATH`` at each; docs/peer-vllm-cpu.md).

    OMP_NUM_THREADS=1 PYTHONPATH=TREE python probes/batch_outputs.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import specpilot.model.layers as layers
    from peer_vllm_cpu import prompts
    from specpilot.config import SystemConfig
    from specpilot.engine.deployment import Deployment

    torch.set_num_threads(1)
    dep = Deployment(args.target, None, dtype="float32", device="cpu")
    ps = [list(dep.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                 add_generation_prompt=True)["input_ids"]) for q in prompts(8)]
    sealed = SystemConfig(drafter="ngram", tree="best_first", nodes=2, depth=2, top_k=2)
    out = {"source": layers.__file__, "torch": torch.__version__, "tokens": args.tokens, "outputs": {}}
    for name, cfg, slots in (("ar_8", SystemConfig.ar(), 8), ("sealed_8", sealed, 8), ("sealed_1", sealed, 1),
                             ("ar_3", SystemConfig.ar(), 3), ("ar_2", SystemConfig.ar(), 2)):
        out["outputs"][name] = [g.tokens for g in dep.batch_system(cfg, slots, max_len=1024).generate_all(ps, args.tokens)]
    out["all_equal_ar_8"] = all(v == out["outputs"]["ar_8"] for v in out["outputs"].values())
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(out["source"], "all equal ar_8:", out["all_equal_ar_8"])


if __name__ == "__main__":
    main()

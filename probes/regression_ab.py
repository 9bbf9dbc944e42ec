"""AR decode of the engine, bf16 and with the ``w12`` mechanism, on the Qwen3-8B shape (random bf16 weights): the two
figures a reshaping of the code must not move (``specpilot bench``'s AR step and the W12 suite's AR decode).

Runs in whichever tree ``specpilot`` imports from, so two trees can be measured in one call on one GPU:
``PYTHONPATH=OLD python probes/regression_ab.py OUT_old.json old`` then ``PYTHONPATH=. python probes/regression_ab.py
OUT_new.json new``. It calls each tree's own functions: ``_ours`` of the engine suite (``specpilot bench``'s AR
figure: 1e3 / ms per decode step, 128 new tokens after a 512-token prompt) and ``decode_tokens_per_s`` of the W12
suite (median of 3 interleaved rounds of 256 tokens, prefill excluded). Before the layout of ``specpilot/bench``
those lived in ``specpilot.benchmark`` and ``specpilot.benchsuite.w12`` (and ``to_w12`` in
``specpilot.mechanisms.w12``), which it falls back to.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch


def _modules():
    try:
        from specpilot.bench import engine as eng_suite
        from specpilot.bench import w12 as w12_suite
        from specpilot.w12.convert import to_w12
    except ImportError:  # the layout before specpilot/bench existed
        from specpilot import benchmark as eng_suite
        from specpilot.benchsuite import w12 as w12_suite
        from specpilot.mechanisms.w12 import to_w12
    return eng_suite, w12_suite, to_w12


def main(out: str, label: str, arch: str = "qwen3-8b", new_tokens: int = 128) -> dict:
    from specpilot.config import SystemConfig
    from specpilot.provenance import git_commit, versions
    from specpilot.zoo.random_ckpt import random_transformer

    eng_suite, w12_suite, to_w12 = _modules()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    tiny = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # ARCH "tiny": a CPU smoke run
    model = random_transformer("qwen3-8b" if arch == "tiny" else arch, dev, overrides=tiny if arch == "tiny" else None)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, model.args.vocab_size, (128,), generator=g).tolist()
    prompt = (base * 4)[:512]  # as `specpilot bench` builds its prompt
    ar = eng_suite._ours(model, SystemConfig.ar(dtype="bfloat16"), prompt, new_tokens, buckets=True)
    print(label, "AR ms/step", ar["ms_per_step"], flush=True)
    full = to_w12(model)
    dec = w12_suite.decode_tokens_per_s({"bf16": model, "w12": full})
    print(label, "decode tokens/s", dec, flush=True)
    res = {"label": label, "commit": git_commit(), "module": eng_suite.__name__, "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
           "versions": versions(), "arch": arch, "bench_ar_ms_per_step": ar["ms_per_step"],
           "bench_ar_tokens_per_s": 1e3 / ar["ms_per_step"], "bench_ar_tokens_sha256": hashlib.sha256(str(ar["tokens"]).encode()).hexdigest()[:16],
           "w12_suite_decode_tokens_per_s": {k: dec[k] for k in ("bf16", "w12")},
           "w12_suite_decode_speedup": dec["w12"] / dec["bf16"], "w12_tokens_equal_bf16": dec["tokens_equal_bf16"],
           "wall_s": time.time() - t0}
    with open(out, "w") as fh:
        json.dump(res, fh, indent=2)
    return res


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python probes/regression_ab.py OUT.json LABEL [ARCH]")
    main(*sys.argv[1:3], *(sys.argv[3:4]))

"""Importing the package, loading a deployment and building and running every kind of system leave torch's
process-wide flags, its random number generator and the environment as they were: no mechanism switches anything
for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import json, os, sys

import torch


def flags():
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    out = {
        "matmul.allow_tf32": m.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction": m.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": m.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": c.allow_tf32, "cudnn.benchmark": c.benchmark, "cudnn.deterministic": c.deterministic,
        "cudnn.enabled": c.enabled, "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()), "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(), "num_threads": torch.get_num_threads(),
        "cpu_rng_state": torch.random.get_rng_state().sum().item(),  # loading builds no module that draws from it
        # torch sets TORCHINDUCTOR_CACHE_DIR itself when one of its modules first imports torch._dynamo
        "environ": {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
    }
    try:
        from triton.runtime import interpreter
        out["triton_interpreter_hook"] = repr(getattr(interpreter, "_patch_lang_tensor", None))
    except ImportError:
        pass
    return out


device = sys.argv[1]
before = flags()
import importlib, pkgutil
import specpilot
for mod in pkgutil.walk_packages(specpilot.__path__, "specpilot."):
    if not mod.name.endswith("__main__"):  # that one runs the command line
        importlib.import_module(mod.name)
from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.zoo import bundled_block_dir, bundled_drafter_dir, bundled_target_dir

dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32" if device == "cpu" else "bfloat16",
                 device=device, block_dirs=[bundled_block_dir()])
ran = []
for cfg in (SystemConfig.ar(), SystemConfig.stock("draft_model"),
            SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2),
            SystemConfig(drafter="block", tree="best_first", nodes=8, depth=6, top_k=4),
            SystemConfig.ar(lm_head_int8=True), SystemConfig.ar(w12=True),
            SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=4, top_k=2, w12=True, lm_head_int8=True)):
    cfg = cfg.model_copy(update={"dtype": dep.dtype})
    dep.system(cfg).generate([1, 2, 3, 4, 5, 6, 7, 8], 6)
    ran.append(cfg.label())
print(json.dumps({"before": before, "after": flags(), "ran": ran}))
"""


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_import_load_and_systems_leave_torch_flags_alone(device):
    p = subprocess.run([sys.executable, "-c", SCRIPT, device], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res["ran"]) == 7  # every kind of system was built and generated with, W12 and the INT8 head included
    changed = {k: (res["before"][k], res["after"].get(k)) for k in res["before"] if res["before"][k] != res["after"].get(k)}
    assert not changed, changed

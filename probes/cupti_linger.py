"""Does a finished PyTorch profiler session slow later kernel launches of the same process (CUPTI left attached,
pytorch/pytorch#144455), and does profiling in a child process (pass_class_fractions_isolated) avoid it?
Times an eager launch-bound loop (400 tiny ops) before, after the isolated profile, and after an in-process one.
Usage: python3 probes/cupti_linger.py OUT.json"""

import json
import sys
import time

import torch

from specpilot.pilot.kernel_profile import pass_class_fractions_isolated, profile_kernels
from specpilot.provenance import git_commit
from specpilot.zoo import bundled_target_dir

x = torch.zeros(16, device="cuda")


def loop_us() -> float:
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(400):
            x.add_(1.0)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e6 / 400)
    return best


if __name__ == "__main__":  # the isolated profile spawns a child that re-imports this file
    res = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "us_per_launch": {}}
    res["us_per_launch"]["before"] = loop_us()
    t0 = time.time()
    res["fractions_isolated"] = pass_class_fractions_isolated(str(bundled_target_dir()), "bfloat16", "cuda", 9, 200)
    res["isolated_s"] = time.time() - t0
    res["us_per_launch"]["after_isolated_profile"] = loop_us()
    profile_kernels(lambda: x.add_(1.0).sum().item(), calls=5)
    res["us_per_launch"]["after_in_process_profile"] = loop_us()
    print(json.dumps(res, indent=1))
    json.dump(res, open(sys.argv[1], "w"), indent=2)

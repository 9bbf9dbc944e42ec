"""``python probes/w12_bench.py OUT.json``: :mod:`specpilot.bench.w12` (also ``specpilot bench --suite w12``);
the probes in this directory import its helpers by name (``from w12_bench import projection_copies``)."""

import sys

from specpilot.bench.w12 import (SHAPES, bits_equal, budget_cli, check, checked_time, codes, copies_of,  # noqa: F401
                                      main, prefix_cli, projection_copies, write_result)

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_bench.py OUT.json")
    try:
        main(sys.argv[1])
    except RuntimeError as e:  # no CUDA GPU: one line, as `specpilot bench --suite w12` says it
        sys.exit(f"w12_bench: {e}")

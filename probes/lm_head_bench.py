"""``python probes/lm_head_bench.py --out OUT.json [--quick] [--bundled] [--no-sweep]``:
:mod:`specpilot.bench.lm_head` (also ``specpilot bench --suite lm-head``)."""

import os
import sys

if "--quick" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specpilot.bench.lm_head import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

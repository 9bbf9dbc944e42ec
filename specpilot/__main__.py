"""``python -m specpilot ...``: the ``specpilot`` command without its console script (e.g. from a source tree on
``PYTHONPATH``)."""

from specpilot.cli import main

main()

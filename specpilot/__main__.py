"""``python -m specpilot ...``: the ``specpilot`` command without its console script (e.g. from a source tree on
``PYTHONPATH``). Guarded: a spawned child process (the ceiling's kernel profile) imports this module again."""

from specpilot.cli import main

if __name__ == "__main__":
    main()

"""The bench scripts' timing helpers, now in the package (:mod:`specpilot.bench.timing`); imported by name
(``from timing import time_calls``) by the scripts in this directory."""

from specpilot.bench.timing import time_calls, time_graph  # noqa: F401

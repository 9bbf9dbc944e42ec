"""Bundled evaluation prompts (GSM8K test, HumanEval, MBPP sanitized, MT-Bench) and their loaders.

See ``prompts/LICENSES.md`` for sources and licences; evaluation only, never training data.
"""

from specpilot.data.benchmarks import BENCHMARKS, PROMPTS_DIR, Request, load_mix, load_requests

__all__ = ["BENCHMARKS", "PROMPTS_DIR", "Request", "load_mix", "load_requests"]

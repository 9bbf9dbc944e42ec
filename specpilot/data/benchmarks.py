"""Request sets from the bundled prompts: one text prompt per record, in file order.

Prompt formats: GSM8K ``Question: {question}\\nAnswer:`` (the training format of the bundled models);
HumanEval the ``prompt`` field (code to continue); MBPP a docstring holding the task and its first test
followed by a newline; MT-Bench the first turn, through the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specpilot.errors import SpecPilotError

BENCHMARKS = ("gsm8k", "humaneval", "mbpp", "mt_bench")
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "humaneval.jsonl",
    "mbpp": "mbpp_sanitized.jsonl",
    "mt_bench": "mt_bench_questions.jsonl",
}


@dataclass
class Request:
    """One evaluation prompt: ``benchmark`` name, 0-based ``index`` in its file, prompt ``text``."""

    benchmark: str
    index: int
    text: str


def _records(name: str) -> list[dict]:
    path = PROMPTS_DIR / FILES[name]
    if not path.is_file():
        raise SpecPilotError(f"bundled prompt file missing: {path} (broken install?)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _text(name: str, r: dict, tokenizer) -> str:
    if name == "gsm8k":
        return f"Question: {r['question']}\nAnswer:"
    if name == "humaneval":
        return r["prompt"]
    if name == "mbpp":
        return f'"""{r["text"]}\n{r["test_list"][0]}\n"""\n'
    turn = r["turns"][0]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
    return turn


def load_requests(name: str, n: int | None = None, tokenizer=None) -> list[Request]:
    """The first ``n`` prompts of a bundled benchmark.

    Args:
        name: one of :data:`BENCHMARKS`.
        n: number of prompts (first n in file order); None = all bundled (at most 200).
        tokenizer: optional HF tokenizer; for ``mt_bench`` its ``chat_template`` renders the first turn
            as a user message with the generation prompt. Ignored by the other benchmarks.
    Returns:
        ``list[Request]`` with non-empty texts.
    Raises:
        SpecPilotError: unknown benchmark name, negative ``n``, or a missing bundled file.
    """
    if name not in BENCHMARKS:
        raise SpecPilotError(f"unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})")
    if n is not None and n < 0:
        raise SpecPilotError(f"number of prompts must be >= 0, got {n}")
    recs = _records(name)[: n if n is not None else None]
    return [Request(name, i, _text(name, r, tokenizer)) for i, r in enumerate(recs)]


def load_mix(n_per_benchmark: int | None = None, tokenizer=None) -> list[Request]:
    """The first ``n_per_benchmark`` prompts of every benchmark, in :data:`BENCHMARKS` order.

    Args:
        n_per_benchmark: prompts per benchmark; None = all bundled.
        tokenizer: passed to :func:`load_requests` (chat template for MT-Bench).
    Returns:
        ``list[Request]``, grouped by benchmark.
    Raises:
        SpecPilotError: as :func:`load_requests`.
    """
    return [r for name in BENCHMARKS for r in load_requests(name, n_per_benchmark, tokenizer)]

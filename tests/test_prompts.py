"""Bundled evaluation prompts: every benchmark loads, formats, errors, licences."""

from __future__ import annotations

import pytest

from specpilot.data import BENCHMARKS, PROMPTS_DIR, Request, load_mix, load_requests
from specpilot.errors import SpecPilotError


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_loads(name):
    reqs = load_requests(name)
    assert 50 <= len(reqs) <= 200
    assert all(isinstance(r, Request) and r.benchmark == name and r.text.strip() for r in reqs)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert len(load_requests(name, n=3)) == 3


def test_formats():
    g = load_requests("gsm8k", 1)[0].text
    assert g.startswith("Question: ") and g.endswith("\nAnswer:")
    h = load_requests("humaneval", 1)[0].text
    assert "def has_close_elements" in h
    m = load_requests("mbpp", 1)[0].text
    assert m.startswith('"""') and "assert " in m and m.endswith('"""\n')
    assert not load_requests("mt_bench", 1)[0].text.startswith("<|im_start|>")


def test_unknown_benchmark_raises():
    with pytest.raises(SpecPilotError, match="unknown benchmark"):
        load_requests("mmlu")


class _ChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and messages[0]["role"] == "user"
        return f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


class _PlainTok:
    chat_template = None


def test_mt_bench_chat_template():
    t = load_requests("mt_bench", 2, tokenizer=_ChatTok())
    assert all(r.text.startswith("<|im_start|>user\n") and r.text.endswith("assistant\n") for r in t)
    plain = load_requests("mt_bench", 2, tokenizer=_PlainTok())
    assert plain[0].text == load_requests("mt_bench", 1)[0].text
    # other benchmarks ignore the template
    assert load_requests("gsm8k", 1, tokenizer=_ChatTok())[0].text.startswith("Question: ")


def test_mix():
    mix = load_mix(2)
    assert [r.benchmark for r in mix] == [b for b in BENCHMARKS for _ in range(2)]


def test_licences_present():
    lic = (PROMPTS_DIR / "LICENSES.md").read_text()
    for s in ("grade-school-math", "human-eval", "mbpp", "FastChat", "MIT", "CC BY 4.0", "Apache-2.0"):
        assert s in lic
    for f in ("gsm8k_test.jsonl", "humaneval.jsonl", "mbpp_sanitized.jsonl", "mt_bench_questions.jsonl"):
        assert (PROMPTS_DIR / f).is_file() and f in lic

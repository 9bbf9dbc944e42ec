"""``specpilot serve`` on a tiny hybrid (qwen3_5, Gated DeltaNet) checkpoint that borrows the bundled tokenizer: the
command as a user runs it answers a chat completion and completions through the ``openai`` client, over the
batched engine's hybrid pool; a completion's text equals the single-request engine's AR output of its prompt."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai

from specpilot.engine.deployment import Deployment
from specpilot.zoo import bundled_target_dir

from .hybridutil import ar_tokens
from .serveutil import served
from .test_hybrid import tiny_hybrid


def test_specpilot_serve_answers_on_a_hybrid_target(tmp_path):
    tdir = tmp_path / "tiny-qwen3_5"
    tiny_hybrid(tdir, seed=4, vocab_size=4096, eos_token_id=0, pad_token_id=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_target_dir() / f, tdir / f)
    dep = Deployment(tdir, None, dtype="float32", device="cpu")
    prompts = ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,"]
    want = [dep.tokenizer.decode(ar_tokens(dep.target, dep.tokenizer(p, add_special_tokens=False)["input_ids"], 8),
                                 skip_special_tokens=True).rstrip("\ufffd") for p in prompts]  # no half character
    env = dict(os.environ, SPECPILOT_API_KEY="k", OMP_NUM_THREADS="1")
    args = ["--target", str(tdir), "--drafter", "ngram", "--tree", "best_first", "--nodes", "4", "--depth", "3",
            "--max-num-seqs", "2", "--log-level", "warning"]
    with served(args, env) as (url, line):
        assert "tiny-qwen3_5" in line and "2 slots" in line
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="tiny-qwen3_5", max_tokens=6,
                                              messages=[{"role": "user", "content": "Say hello."}])
        assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
        assert 1 <= chat.usage.completion_tokens <= 6 and chat.choices[0].finish_reason in ("stop", "length")
        with ThreadPoolExecutor(3) as pool:  # three requests on two slots: one waits, then joins the batch
            got = list(pool.map(lambda p: client.completions.create(model="tiny-qwen3_5", prompt=p, max_tokens=8),
                                prompts))
        assert [r.choices[0].text for r in got] == want

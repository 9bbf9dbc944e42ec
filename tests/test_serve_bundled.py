"""``specpilot serve`` over the real batched engine on the bundled pair (target + draft model, float32, CPU), with
the ``openai`` client against a uvicorn server in a thread: completions and chat, streamed and not, stop strings,
usage, 4xx, 401 without the key, a disconnect that frees its slot, the metrics; and 200 concurrent requests of
mixed lengths and budgets (1 included), among clients that hang up mid-stream and requests refused with a 400:
none lost, each equal to the single-request engine's output of its prompt, every slot back after (R4, R12, R14,
R17, R18)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import load_requests
from specpilot.engine.deployment import Deployment
from specpilot.serve.app import create_app
from specpilot.serve.chat import choose_template
from specpilot.serve.driver import EngineDriver
from specpilot.serve.metrics import ServerMetrics
from specpilot.serve.run import ServeContext
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .serve_fake import ServerThread

KEY = "test-key"
CFG = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=4, top_k=2)
SLOTS = 8


@pytest.fixture(scope="module")
def srv():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core CI machine: one intra-op thread for the engine, the other for HTTP
    dep = Deployment(bundled_target_dir(), bundled_drafter_dir(), dtype="float32", device="cpu")
    engine = dep.batch_system(CFG, SLOTS)
    metrics = ServerMetrics("bundled")
    template, source = choose_template(dep.tokenizer)
    ctx = ServeContext(driver=EngineDriver(engine, metrics), tokenizer=dep.tokenizer, model_name="bundled",
                       max_len=engine.max_len, vocab_size=dep.target.args.vocab_size, eos_ids=frozenset(dep.eos_ids()),
                       metrics=metrics, chat_template=template, chat_source=source, api_key=KEY)
    try:
        with ServerThread(create_app(ctx)) as s:
            s.dep, s.ctx, s.single = dep, ctx, dep.system(CFG)
            yield s
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def reference(srv, ids, max_tokens):
    """``(text, completion tokens, finish_reason)`` of the single-request engine on ``ids`` (a character cut in two
    at the end is left out, as the server leaves it out)."""
    g = srv.single.generate(ids, max_tokens)
    return srv.dep.tokenizer.decode(g.tokens, skip_special_tokens=True).rstrip("\ufffd"), len(g.tokens), \
        "length" if g.stop_reason == "length" else "stop"


def ids_of(srv, text):
    return srv.dep.tokenizer(text, add_special_tokens=False)["input_ids"]


def counter(srv, name):
    fams = text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
    return sum(s.value for f in fams for s in f.samples if s.name == name)


def wait_free(srv, timeout_s=30.0):
    t0 = time.time()
    while srv.ctx.driver.free_slots != SLOTS:
        assert time.time() - t0 < timeout_s, "slots not freed"
        time.sleep(0.02)


PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def test_a_repeated_prompt_reuses_its_prefix_and_metrics_count_it(srv, client):
    """The same long prompt twice, one after the other: the second starts from the K/V the first left (its slot is
    free, not yet reused), gives the same text as the single-request engine, and /metrics counts the reused tokens."""
    prompt = PROMPT * 3  # well past the 16 shared tokens reuse starts at
    ids = ids_of(srv, prompt)
    text, _, _ = reference(srv, ids, 12)
    q0, h0 = counter(srv, "specpilot:prefix_cache_queries_total"), counter(srv, "specpilot:prefix_cache_hits_total")
    for _ in range(2):
        assert client.completions.create(model="bundled", prompt=prompt, max_tokens=12).choices[0].text == text
    wait_free(srv)
    assert counter(srv, "specpilot:prefix_cache_queries_total") - q0 == 2 * len(ids)
    assert counter(srv, "specpilot:prefix_cache_hits_total") - h0 >= len(ids) - 1


def test_completion_and_chat_equal_the_single_request_engine(srv, client):
    text, n, reason = reference(srv, ids_of(srv, PROMPT), 40)
    r = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=40)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason)
    chunks = list(client.completions.create(model="bundled", prompt=PROMPT, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n and not any("\ufffd" in (c.choices[0].text if c.choices else "")
                                                               for c in chunks)
    msgs = [{"role": "user", "content": "Write a function that adds two numbers."}]
    rendered = srv.dep.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat_ids = srv.dep.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text, n, reason = reference(srv, chat_ids, 30)
    r = client.chat.completions.create(model="bundled", messages=msgs, max_completion_tokens=30)
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens) == (text, n, len(chat_ids))
    streamed = list(client.chat.completions.create(model="bundled", messages=msgs, max_tokens=30, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert client.completions.create(model="bundled", prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_stop_string_cuts_and_frees_the_slot(srv, client):
    text, _, _ = reference(srv, ids_of(srv, PROMPT), 60)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    before = counter(srv, "specpilot:generation_tokens_total")
    r = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=1500, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    wait_free(srv)
    # the engine stopped soon after the cut (1,500 tokens were allowed)
    assert counter(srv, "specpilot:generation_tokens_total") - before <= r.usage.completion_tokens + 300
    streamed = list(client.completions.create(model="bundled", prompt=PROMPT, max_tokens=1500, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_4xx_401_and_the_server_goes_on(srv, client):
    for kw in ({"temperature": 0.8}, {"n": 2}, {"max_tokens": srv.ctx.max_len}, {"prompt": "a" * 10_000}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**({"model": "bundled", "prompt": PROMPT, "max_tokens": 4} | kw))
    r = httpx.post(srv.url + "/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).completions.create(
            model="bundled", prompt=PROMPT, max_tokens=2)
    assert client.completions.create(model="bundled", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_disconnect_frees_the_slot(srv):
    before = counter(srv, "specpilot:generation_tokens_total")
    body = {"model": "bundled", "prompt": PROMPT, "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", srv.url + "/v1/completions", json=body,
                                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 2:
                break
    wait_free(srv)
    assert counter(srv, "specpilot:generation_tokens_total") - before < 1000  # far from the 2,000 allowed
    assert counter(srv, "specpilot:request_success_total") >= 1


def test_two_hundred_concurrent_requests_equal_single_request_outputs(srv):
    tok, rng = srv.dep.tokenizer, random.Random(0)
    texts = [r.text for b in ("gsm8k", "humaneval", "mbpp") for r in load_requests(b, 12, tok)]
    jobs = []
    for i in range(200):
        ids = ids_of(srv, texts[i % len(texts)])
        jobs.append((ids[:rng.randint(4, min(len(ids), 100))], rng.choice([1, 1, 2, 5, 9, 16, 24]), i % 4 == 0))
    want = [reference(srv, ids, n) for ids, n, _ in jobs]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(ids, n, stream):
            if stream:
                chunks = [c async for c in await client.completions.create(
                    model="bundled", prompt=ids, max_tokens=n, stream=True, stream_options={"include_usage": True})]
                fin = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens, fin
            r = await client.completions.create(model="bundled", prompt=ids, max_tokens=n)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

        async def hang_up(ids):  # a client that leaves after its first chunk (its request is aborted mid-batch)
            stream = await client.completions.create(model="bundled", prompt=ids, max_tokens=300, stream=True)
            async for _ in stream:
                break
            await stream.close()

        async def refused(ids):
            try:
                await client.completions.create(model="bundled", prompt=ids, max_tokens=5, temperature=0.5)
            except openai.BadRequestError:
                return True

        try:
            extra = [hang_up(jobs[i][0]) for i in range(0, 200, 20)] + [refused(jobs[i][0]) for i in range(0, 200, 40)]
            res = await asyncio.gather(*(one(*j) for j in jobs), *extra)
            assert all(res[200 + 10:])
            return res[:200]
        finally:
            await client.close()

    aborts = "specpilot:request_success_total"
    before = sum(s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                 for s in f.samples if s.name == aborts and s.labels["finished_reason"] == "abort")
    got = asyncio.run(run_all())
    assert len(got) == 200
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if tuple(g) != w]
    assert not bad, [(i, got[i], want[i]) for i in bad[:3]]
    wait_free(srv)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    after = sum(s.value for s in fams["specpilot:request_success"].samples
                if s.name == aborts and s.labels["finished_reason"] == "abort")
    assert 1 <= after - before <= 10  # the clients that hung up (one whose output hit EOS first ended as 'stop')
    drafts = sum(s.value for s in fams["specpilot:spec_decode_num_drafts"].samples if s.name.endswith("_total"))
    assert drafts > 0 and json.dumps(sorted(fams)).count("specpilot:") >= 10

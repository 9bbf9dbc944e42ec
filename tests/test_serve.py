"""``specpilot serve``'s HTTP API with the ``openai`` client against a real uvicorn server (in a thread), over the
scripted engine of :mod:`tests.serve_fake`: completions and chat, streamed and not, stop strings and ids, usage,
4xx for malformed and unsupported requests, 401 with an API key, disconnects that free their slot, an engine
failure answered with a 500 while the server goes on, and the Prometheus metrics (R15, R17)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specpilot.model.checkpoint import load_tokenizer
from specpilot.serve.app import create_app
from specpilot.serve.chat import choose_template
from specpilot.serve.driver import EngineDriver
from specpilot.serve.metrics import ServerMetrics
from specpilot.serve.run import ServeContext
from specpilot.zoo import bundled_target_dir

from .serve_fake import SCRIPT, FakeBatchEngine, ServerThread

TOK = load_tokenizer(bundled_target_dir())
EOS = 0


def make_app(engine, api_key=None, max_body_bytes=1 << 16):
    metrics = ServerMetrics("fake")
    template, source = choose_template(TOK)
    ctx = ServeContext(driver=EngineDriver(engine, metrics), tokenizer=TOK, model_name="fake", max_len=engine.max_len,
                       vocab_size=engine.vocab_size, eos_ids=frozenset([EOS]), metrics=metrics, chat_template=template,
                       chat_source=source, api_key=api_key, max_body_bytes=max_body_bytes)
    return ctx, create_app(ctx)


@pytest.fixture(scope="module")
def srv():
    eng = FakeBatchEngine(TOK, EOS, num_slots=4, step_delay_s=0.001)
    ctx, app = make_app(eng)
    with ServerThread(app) as s:
        s.eng, s.ctx = eng, ctx
        yield s


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def text_of(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def reply_of(ids):
    """The text of a reply cut by max_tokens after ``ids``: a character cut in two is left out, not a U+FFFD."""
    return text_of(ids).rstrip("\ufffd")


def wait_idle(srv, timeout_s=10.0):
    """Until the engine holds nothing and the driver saw every slot free."""
    t0 = time.time()
    while srv.eng.running or srv.eng.waiting or srv.ctx.driver.free_slots != srv.eng.num_slots:
        assert time.time() - t0 < timeout_s, "slots not freed"
        time.sleep(0.01)


def test_models_and_health(srv, client):
    card = client.models.list().data[0]
    assert card.id == "fake" and card.max_model_len == srv.eng.max_len and card.chat_template == "tokenizer"
    assert client.models.retrieve("fake").id == "fake"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_completion_stream_equals_text_and_usage(srv, client):
    r = client.completions.create(model="fake", prompt="Hello", max_tokens=40)
    assert r.choices[0].text == text_of(srv.eng.expected(40)) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(TOK("Hello")["input_ids"]), 40)
    chunks = list(client.completions.create(model="fake", prompt="Hello", max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == r.choices[0].text and len(texts) > 5
    assert not any("\ufffd" in t for t in texts)  # é, 日本語 and 🙂 are split across byte tokens in SCRIPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])
    ids = TOK("Hello")["input_ids"]
    for prompt in (ids, ["Hello"], [ids]):  # token ids, and a list of one prompt
        again = client.completions.create(model="fake", prompt=prompt, max_tokens=40)
        assert again.choices[0].text == r.choices[0].text
    assert client.completions.create(model="fake", prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_a_length_cut_inside_a_character_ends_without_a_replacement_character(srv, client):
    """max_tokens reached after part of a multi-byte character: the reply (streamed or not) ends before it, with no
    U+FFFD, and every token still counts in usage."""
    n = next(n for n in range(1, 40) if text_of(srv.eng.script[:n]).endswith("\ufffd"))
    r = client.completions.create(model="fake", prompt="Hello", max_tokens=n)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == \
        (reply_of(srv.eng.script[:n]), "length", n)
    chunks = list(client.completions.create(model="fake", prompt="Hello", max_tokens=n, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text and "\ufffd" not in c.text


def test_chat_stream_and_not(srv, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake", messages=msgs, max_completion_tokens=20)
    assert r.choices[0].message.content == text_of(srv.eng.expected(20)) and r.usage.completion_tokens == 20
    rendered = TOK.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(TOK(rendered, add_special_tokens=False)["input_ids"])
    chunks = list(client.chat.completions.create(model="fake", messages=msgs, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert client.chat.completions.create(model="fake", messages=parts, max_tokens=3).usage.completion_tokens == 3


def test_stop_string_spanning_tokens_aborts_the_request(srv, client):
    pieces = [TOK.decode([t]) for t in srv.eng.script]
    assert "STOP" not in pieces and "".join(pieces).count("STOP") == 1  # the stop string spans two tokens
    want = SCRIPT[:SCRIPT.index("STOP")]
    # [slow]: 50 ms a step, so the request is still running (200 tokens allowed) when the server aborts it
    r = client.completions.create(model="fake", prompt="[slow] Hello", max_tokens=200, stop=["STOP", "never"])
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", "STOP")
    wait_idle(srv)
    assert r.id in srv.eng.aborted and r.id not in srv.eng.finished  # the engine was told: its slot is free
    chunks = list(client.completions.create(model="fake", prompt="Hello", max_tokens=60, stop="STOP", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    inc = client.completions.create(model="fake", prompt="Hello", max_tokens=60, stop=["STOP"],
                                    extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == want + "STOP"
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=60,
                                       stop=["wörld 日"])
    assert r.choices[0].message.content == "héllo " and r.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_eos(srv, client):
    sid = srv.eng.script[5]
    first = srv.eng.script.index(sid)
    r = client.completions.create(model="fake", prompt="Hello", max_tokens=30, extra_body={"stop_token_ids": [sid]})
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text_of(srv.eng.script[:first]), "stop", sid)
    assert r.usage.completion_tokens == first + 1  # the stop token counts, its text is left out (as in vLLM)
    r = client.completions.create(model="fake", prompt="Hello [eos:4]", max_tokens=30)
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason, r.usage.completion_tokens) == \
        (text_of(srv.eng.script[:4]), "stop", None, 5)


@pytest.mark.parametrize("kw", [
    {"temperature": 0.7}, {"top_p": 0.5}, {"n": 2}, {"logprobs": 2}, {"presence_penalty": 0.5},
    {"frequency_penalty": 0.1}, {"logit_bias": {"5": 1}}, {"best_of": 2}, {"echo": True}, {"suffix": "x"},
    {"extra_body": {"top_k": 5}}, {"extra_body": {"min_p": 0.1}}, {"extra_body": {"ignore_eos": True}},
    {"extra_body": {"foo": 1}}, {"extra_body": {"stop_token_ids": [99999]}}, {"max_tokens": 255},
    {"model": "other"}, {"prompt": ["a", "b"]}, {"prompt": ""},
    {"prompt": "word " * 300}, {"stream_options": {"include_usage": True}}, {"max_tokens": 0},
])
def test_unsupported_or_malformed_completion_is_4xx(srv, client, kw):
    args = {"model": "fake", "prompt": "Hello", "max_tokens": 4} | kw
    with pytest.raises(openai.APIStatusError) as ei:
        client.completions.create(**args)
    e = ei.value
    assert e.status_code == (404 if "model" in kw else 400), e.body
    assert set(e.body) == {"message", "type", "param", "code"} and e.body["message"]
    field = next(iter(kw["extra_body"])) if "extra_body" in kw else next(iter(kw))
    if field not in ("prompt", "stop", "stream_options", "foo", "max_tokens"):
        assert e.body["param"] == field, e.body
    if field in ("temperature", "top_p", "n", "presence_penalty", "top_k", "min_p"):
        assert "greedy" in e.body["message"], e.body
    if field in ("echo", "suffix", "logprobs", "ignore_eos"):  # not sampling: says what is wrong, nothing of greedy
        assert e.body["message"].startswith(f"{field}=") and "greedy" not in e.body["message"], e.body
    if field == "echo":
        assert e.body["message"] == ("echo=True is not supported: the server does not echo the prompt (send false or "
                                     "omit it); the request was not run")


@pytest.mark.parametrize("kw", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, {"logprobs": True},
    {"response_format": {"type": "json_object"}}, {"n": 3}, {"temperature": 1.0},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    {"messages": []}, {"max_completion_tokens": 10_000},
])
def test_unsupported_or_malformed_chat_is_400(srv, client, kw):
    args = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | kw
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(**args)
    assert ei.value.body["message"]


@pytest.mark.parametrize("body,what", [
    (b"{bad", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'{"prompt": "a", "max_tokens": "ten"}', "max_tokens"),
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8"), (b'{"prompt": "\\ud800"}', "lone surrogate"),
    (b'{"prompt": "a", "stop": ["\\udce9"]}', "byte 0xe9"),
    (b'{"messages": [{"role": "user", "content": "\\udce9"}]}', "messages[0].content"),
    (b'{"prompt": [1.5]}', "prompt"), (b'{"max_tokens": 3}', "prompt"), (b"[" * 60_000, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "a text part needs a string 'text'"),
    (b'{"prompt": "a", "frobnicate": 1}', "unknown field 'frobnicate': not supported by this server"),
], ids=lambda v: v[:20] if isinstance(v, bytes) else None)
def test_malformed_body_is_400_json(srv, body, what):
    path = "/v1/chat/completions" if body.startswith(b'{"messages"') else "/v1/completions"
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and what in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,param", [({"prompt": "a", "stop": [""]}, "stop"),
                                        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options")])
def test_refusals_carry_a_code(srv, body, param):
    r = httpx.post(srv.url + "/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "invalid_value", r.text


def test_limits_and_unknown_paths(srv, client):
    r = httpx.post(srv.url + "/v1/completions", content=json.dumps({"prompt": "x" * 100_000}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(srv.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    assert client.completions.create(model="fake", prompt="still here", max_tokens=3).usage.completion_tokens == 3
    wait_idle(srv)


def test_greedy_equivalents_are_accepted(srv, client):
    r = client.completions.create(model="fake", prompt="Hello", max_tokens=5, temperature=0, top_p=1, seed=7, n=1,
                                  user="u", extra_body={"top_k": -1, "repetition_penalty": 1.0})
    assert r.choices[0].text == text_of(srv.eng.expected(5))


def _stream_then_hang_up(url, body, events=2):
    """POST a streaming request, read ``events`` data events, close the connection; returns the response id."""
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid = json.loads(line[6:])["id"]
                n += 1
                if n == events:
                    return rid
    raise AssertionError("stream ended early")


def test_disconnect_frees_the_slot_and_others_go_on(srv, client):
    with cf.ThreadPoolExecutor(1) as pool:
        other = pool.submit(client.completions.create, model="fake", prompt="other", max_tokens=60)
        rid = _stream_then_hang_up(srv.url, {"prompt": "[slow] long", "max_tokens": 200, "stream": True})
        assert other.result().choices[0].text == reply_of(srv.eng.expected(60))
    wait_idle(srv)
    assert rid in srv.eng.aborted and rid not in srv.eng.finished
    n = len(srv.eng.aborted)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(srv.url + "/v1/completions", json={"prompt": "[slow] x", "max_tokens": 200}, timeout=0.3)
    wait_idle(srv)
    assert len(srv.eng.aborted) == n + 1


def test_engine_failure_is_500_and_the_server_goes_on(srv, client):
    with pytest.raises(openai.InternalServerError) as ei:
        client.completions.create(model="fake", prompt="[fail] x", max_tokens=5)
    assert "planted engine failure" in ei.value.body["message"]
    with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "[fail] y", "max_tokens": 5,
                                                                  "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert "planted engine failure" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    t0 = time.time()  # the driver resets after failing the step's requests, which the stream may see first
    while srv.eng.resets < 2 and time.time() - t0 < 10:
        time.sleep(0.01)
    assert srv.eng.resets == 2  # after each failed step the engine was reset to a known state
    assert client.completions.create(model="fake", prompt="ok", max_tokens=4).usage.completion_tokens == 4
    wait_idle(srv)


def test_many_concurrent_requests_none_lost(srv, client):
    jobs = [(f"request {i}", 1 + (7 * i) % 50, i % 3 == 0) for i in range(40)]

    def one(job):
        prompt, max_tokens, stream = job
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(
                model="fake", prompt=prompt, max_tokens=max_tokens, stream=True))
        return client.completions.create(model="fake", prompt=prompt, max_tokens=max_tokens).choices[0].text

    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, jobs))
    assert texts == [reply_of(srv.eng.expected(m)) for _, m, _ in jobs]
    wait_idle(srv)
    assert len(srv.eng.threads) == 1  # only the driver's thread ever touched the engine


def test_metrics_parse_with_speculative_counters(srv, client):
    client.completions.create(model="fake", prompt="Hello", max_tokens=30)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "request_success", "prompt_tokens",
                 "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos"):
        assert "specpilot:" + name in families, name
    val = {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in families.values() for s in f.samples}
    pre = "specpilot:spec_decode_num_"
    drafts = val[pre + 'drafts_total{"model_name": "fake"}']
    accepted = val[pre + 'accepted_tokens_total{"model_name": "fake"}']
    per_pos = {k: v for k, v in val.items() if k.startswith(pre + "accepted_tokens_per_pos_total")}
    assert drafts > 0 and 0 < accepted <= val[pre + 'draft_tokens_total{"model_name": "fake"}']
    assert sum(per_pos.values()) == accepted and any('"position": "0"' in k for k in per_pos)
    assert val['specpilot:time_to_first_token_seconds_count{"model_name": "fake"}'] >= 1
    assert val['specpilot:request_success_total{"finished_reason": "length", "model_name": "fake"}'] >= 1


def test_api_key_gives_401_without_it():
    eng = FakeBatchEngine(TOK, EOS, num_slots=2)
    _, app = make_app(eng, api_key="sekret")
    with ServerThread(app) as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="fake", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="fake", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/metrics").status_code == 200

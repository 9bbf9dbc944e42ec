"""Token forcing (§3.4) on a tiny random Qwen3 in float32."""

import pytest
import torch

from specpilot.pilot.forcing import (
    ForcingStats, Scorer, audit, delta_from_phase0, forcing_verdict, round_delta,
)

V = 96


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specpilot.engine.checkpoint import load_model

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.2)
    d = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    return load_model(d)


@torch.inference_mode()
def greedy(model, prompt, n, bias=None):
    """AR greedy with an incremental cache (like the engine); ``bias [V]`` is a planted logit defect."""
    cache = model.new_cache(len(prompt) + n)
    h = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache, 0)
    out, pos = [], len(prompt)
    for _ in range(n):
        lg = model.logits(h[-1:])[0]
        tok = int((lg if bias is None else lg + bias).argmax())
        out.append(tok)
        h = model.forward(torch.tensor([tok]), torch.tensor([pos]), cache, pos)
        pos += 1
    return out


@pytest.fixture(scope="module")
def data(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(6)]
    bias = torch.zeros(V)
    bias[[3, 7, 11, 19]] = 0.3
    clean = [greedy(model, p, 40) for p in prompts]
    bad = [greedy(model, p, 40, bias) for p in prompts]
    return prompts, clean, bad


def test_score_matches_definition(model, data):
    prompts, clean, _ = data
    sc = Scorer(model)
    out = list(clean[0])
    out[5] = (out[5] + 1) % V  # force one wrong token
    s = sc.score(prompts[0], out)
    assert s.tokens.shape == s.argmax.shape == s.margin.shape == (40,)
    assert s.mismatch[5] and s.margin[5] > 0 and (s.margin[~s.mismatch] == 0).all()
    logp = sc.next_logprobs(prompts[0] + out[:5])
    assert int(logp.argmax()) == s.argmax[5]
    assert s.margin[5] == pytest.approx(float(logp.max() - logp[out[5]]), abs=1e-5)
    assert sc.score(prompts[0], []).tokens.size == 0


def test_lossless_passes_and_defect_rejected(model, data):
    prompts, clean, bad = data
    sc = Scorer(model)
    assert clean != bad  # the planted bias flips some tokens
    stock = audit(sc, [(p, o, "b0" if i < 3 else "b1") for i, (p, o) in enumerate(zip(prompts, clean))], 0.125)
    assert stock.tokens == 240 and stock.mismatches == 0 and stock.mismatch_rate == 0.0
    assert set(stock.per_benchmark) == {"b0", "b1"} and stock.per_benchmark["b0"]["tokens"] == 120
    ok, reasons = forcing_verdict(stock, stock)
    assert ok and reasons == []
    sys = audit(sc, [(p, o, "b0") for p, o in zip(prompts, bad)], 0.125)
    assert sys.mismatch_rate > 0.005 and sys.top_margins == sorted(sys.top_margins, reverse=True)
    assert all(0 < m <= 0.3 + 1e-4 for m in sys.top_margins)  # a bias b flips only gaps < b
    ok, reasons = forcing_verdict(sys, stock)
    assert not ok and any("mismatch rate" in r for r in reasons)
    assert sys.to_dict()["mismatches"] == sys.mismatches


def test_verdict_rules():
    stock = ForcingStats(delta=0.25, tokens=10000, mismatches=72, events=2)
    # allowance 0.5 pp + 2 standard errors of the difference: 2 * sqrt(2) * sqrt(.0072 * .9928 / 1e4) = 0.239 pp
    assert forcing_verdict(ForcingStats(0.25, 10000, 145, 2), stock)[0]  # 1.45% < 0.72% + 0.739 pp
    ok, r = forcing_verdict(ForcingStats(0.25, 10000, 146, 2), stock)  # 1.46%
    assert not ok and len(r) == 1 and "0.74 pp" in r[0]
    never = ForcingStats(0.25, 1000, 0, 0)  # a stock that never mismatches: the paper's bare 0.5 pp
    assert forcing_verdict(ForcingStats(0.25, 1000, 5, 0), never)[0]
    assert not forcing_verdict(ForcingStats(0.25, 1000, 6, 0), never)[0]
    flat = ForcingStats(0.125, 1152, 122, 0)  # random weights on the H200: stock itself at 10.59%
    assert forcing_verdict(ForcingStats(0.125, 1152, 138, 0), flat)[0]  # 11.98%: AR there (was rejected)
    assert forcing_verdict(ForcingStats(0.125, 1152, 157, 0), flat)[0]  # 13.63% < 10.59% + 3.06 pp
    assert not forcing_verdict(ForcingStats(0.125, 1152, 158, 0), flat)[0]  # 13.72%
    assert forcing_verdict(ForcingStats(0.25, 10000, 72, 3), stock)[0]  # 3 events vs 2: chance (p = 0.5)
    ok, r = forcing_verdict(ForcingStats(0.25, 10000, 72, 12), stock)  # 12 vs 2: p = 106 / 2^14 = 0.0065
    assert not ok and len(r) == 1 and "events" in r[0] and "p = 0.00647" in r[0]
    # session 7's seal on the H200 (flat logits): one event at 0.26 nats against stock's none
    assert forcing_verdict(ForcingStats(0.125, 1152, 120, 1), ForcingStats(0.125, 1152, 107, 0))[0]
    with pytest.raises(ValueError):
        forcing_verdict(ForcingStats(0.125, 10, 0, 0), stock)


def test_rate_se_is_cluster_robust_over_requests():
    import math
    from specpilot.pilot.forcing import mismatch_allowance, rate_se
    even = ForcingStats(0.25, 400, 40, 0, per_request=[(100, 10)] * 4)  # no spread between requests
    assert rate_se(even) == pytest.approx(math.sqrt(0.1 * 0.9 / 400))  # the binomial error wins
    lumpy = ForcingStats(0.25, 400, 40, 0, per_request=[(100, 0), (100, 0), (100, 5), (100, 35)])
    r = 0.1  # by hand: residuals m - r t = -10, -10, -5, 25
    want = math.sqrt(4 / 3 * (100 + 100 + 25 + 625)) / 400
    assert rate_se(lumpy) == pytest.approx(want) and want > math.sqrt(r * (1 - r) / 400)
    assert rate_se(ForcingStats(0.25)) == 0.0
    # the allowance reads the baseline only: a lumpy system gets no more room than an even one
    sys_lumpy = ForcingStats(0.25, 400, 60, 0, per_request=[(100, 0), (100, 0), (100, 0), (100, 60)])
    assert mismatch_allowance(sys_lumpy, even) == mismatch_allowance(ForcingStats(0.25, 400, 60, 0), even)
    assert mismatch_allowance(sys_lumpy, even) == pytest.approx(0.005 + 2 * math.sqrt(2) * rate_se(even))
    assert mismatch_allowance(sys_lumpy, lumpy) == pytest.approx(0.005 + 2 * math.sqrt(2) * want)
    # a lumpy baseline at 10% (four requests) lets a system at 15% through (10 + 0.5 + 23.8 pp); an even one not (10 + 0.5 + 4.24)
    assert forcing_verdict(sys_lumpy, lumpy)[0] and not forcing_verdict(sys_lumpy, even)[0]


def test_audit_records_per_request_counts(model, data):
    prompts, clean, bad = data
    sc = Scorer(model)
    st = audit(sc, [(p, o, "b") for p, o in zip(prompts, bad)], 0.125)
    assert len(st.per_request) == len(prompts)
    assert sum(t for t, _ in st.per_request) == st.tokens and sum(m for _, m in st.per_request) == st.mismatches
    for (t, m), p, o in zip(st.per_request, prompts, bad):
        assert t == len(o) and m == int(sc.score(p, o).mismatch.sum())
    assert st.to_dict()["per_request"] == [list(r) for r in st.per_request]


def test_event_p_value_is_the_exact_count_test():
    import math
    from specpilot.pilot.forcing import EVENT_ALPHA, event_p_value
    zero = ForcingStats(0.25, 1000, 0, 0)
    assert event_p_value(zero, zero) == 1.0
    assert event_p_value(ForcingStats(0.25, 1000, 0, 0), ForcingStats(0.25, 1000, 0, 9)) == 1.0
    # equal token counts, stock at zero: P = 0.5^a; five events pass, six are rejected
    assert event_p_value(ForcingStats(0.25, 1000, 5, 5), zero) == pytest.approx(0.5 ** 5)
    assert event_p_value(ForcingStats(0.25, 1000, 6, 6), zero) == pytest.approx(0.5 ** 6)
    assert 0.5 ** 6 < EVENT_ALPHA < 0.5 ** 5
    assert forcing_verdict(ForcingStats(0.25, 1000, 5, 5), zero)[0]
    assert not forcing_verdict(ForcingStats(0.25, 1000, 6, 6), zero)[0]
    # unequal exposure, by hand: a = 4 of k = 5 with q = 3000 / 4000
    q, a, k = 0.75, 4, 5
    want = sum(math.comb(k, i) * q ** i * (1 - q) ** (k - i) for i in range(a, k + 1))
    got = event_p_value(ForcingStats(0.25, 3000, 10, 4), ForcingStats(0.25, 1000, 10, 1))
    assert got == pytest.approx(want, rel=1e-9)


def test_delta(model, data):
    prompts, clean, bad = data
    sc = Scorer(model)
    assert round_delta(0.232) == 0.25 and round_delta(0.25) == 0.25 and round_delta(0.0) == 0.125
    assert round_delta(0.126) == 0.25 and round_delta(1.0) == 1.0
    assert delta_from_phase0(sc, prompts, clean, clean) == 0.125  # stock never diverges
    # stock = defective: δ covers the largest margin at the first divergence, rounded up to 1/8
    d = delta_from_phase0(sc, prompts, clean, bad)
    worst = 0.0
    for p, a, b in zip(prompts, clean, bad):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is not None:
            worst = max(worst, float(sc.score(p, b[: k + 1]).margin[k]))
    assert worst > 0 and d >= worst and d - worst < 0.125 and (d * 8) == int(d * 8)
    with pytest.raises(ValueError):
        delta_from_phase0(sc, prompts, clean, clean[:-1])

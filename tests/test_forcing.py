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

    from specpilot.model.checkpoint import load_model

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
    # allowance 0.5 pp + 2 standard errors of stock's 0.72% over 10^4 tokens = 0.669 pp
    assert forcing_verdict(ForcingStats(0.25, 10000, 138, 2), stock)[0]  # +0.66 pp, same events
    ok, r = forcing_verdict(ForcingStats(0.25, 10000, 140, 2), stock)  # +0.68 pp
    assert not ok and len(r) == 1 and "0.67 pp" in r[0]
    never = ForcingStats(0.25, 1000, 0, 0)  # a stock that never mismatches: the paper's bare 0.5 pp
    assert forcing_verdict(ForcingStats(0.25, 1000, 5, 0), never)[0]
    assert not forcing_verdict(ForcingStats(0.25, 1000, 6, 0), never)[0]
    flat = ForcingStats(0.125, 1152, 122, 0)  # random weights on the H200: stock itself at 10.59%
    assert forcing_verdict(ForcingStats(0.125, 1152, 138, 0), flat)[0]  # 11.98%: AR there (was rejected)
    assert not forcing_verdict(ForcingStats(0.125, 1152, 150, 0), flat)[0]  # 13.02% > 10.59% + 2.31 pp
    ok, r = forcing_verdict(ForcingStats(0.25, 10000, 72, 3), stock)  # more events than stock
    assert not ok and "events" in r[0]
    with pytest.raises(ValueError):
        forcing_verdict(ForcingStats(0.125, 10, 0, 0), stock)


def test_audit_records_per_request_counts(model, data):
    prompts, clean, bad = data
    sc = Scorer(model)
    st = audit(sc, [(p, o, "b") for p, o in zip(prompts, bad)], 0.125)
    assert len(st.per_request) == len(prompts)
    assert sum(r[0] for r in st.per_request) == st.tokens and sum(r[1] for r in st.per_request) == st.mismatches
    for (t, m, e), p, o in zip(st.per_request, prompts, bad):
        s = sc.score(p, o)
        assert t == len(o) and m == int(s.mismatch.sum()) and e == int((s.mismatch & (s.margin >= 0.25)).sum())
    assert st.to_dict()["per_request"] == [list(r) for r in st.per_request]


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


def test_merged_figures_equal_one_audit_of_all_outputs(model, data):
    prompts, clean, bad = data
    outs = [(p, o, "b" if i % 2 else "a") for i, (p, o) in enumerate(zip(prompts, bad))]
    sc = Scorer(model)
    whole = audit(sc, outs, 0.125)
    parts = ForcingStats.merged([audit(sc, outs[:1], 0.125), audit(sc, outs[1:], 0.125)])
    assert parts.to_dict() == whole.to_dict()
    with pytest.raises(ValueError):
        ForcingStats.merged([audit(sc, outs[:1], 0.125), audit(sc, outs[1:], 0.25)])

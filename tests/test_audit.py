"""``specpilot audit`` (§3.4): token forcing of any engine's outputs from a JSONL file."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot.forcing import Scorer
from specpilot.pilot.setup import build_requests
from specpilot.zoo import bundled_target_dir

from .test_cli import run_cli

TARGET = str(bundled_target_dir())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ar_rows():
    dep = Deployment(bundled_target_dir())
    ar = dep.system(SystemConfig.ar())
    rows = []
    for r in build_requests(dep, per_benchmark=1, max_new_tokens=24):
        rows.append({"prompt_ids": list(r.prompt_ids), "output_ids": ar.generate(list(r.prompt_ids), 24).tokens,
                     "benchmark": r.benchmark, "engine": "specpilot AR"})
    return dep, rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def audit_json(monkeypatch, capsys, *args):
    code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", TARGET, "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


def test_our_ar_outputs_pass(monkeypatch, capsys, tmp_path, ar_rows):
    _, rows = ar_rows
    code, res = audit_json(monkeypatch, capsys, "--outputs", write(tmp_path / "ar.jsonl", rows))
    a = res["audited"]
    assert code == 0 and res["passed"] and res["reasons"] == []
    assert a["tokens"] == sum(len(r["output_ids"]) for r in rows) and a["mismatches"] == 0 and a["events"] == 0
    assert set(a["per_benchmark"]) == {r["benchmark"] for r in rows}
    assert res["delta"] == 0.125 and res["event_margin"] == 0.25 and res["lines"] == len(rows)
    code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", TARGET, "--outputs", str(tmp_path / "ar.jsonl"))
    assert code == 0 and "verdict: passed" in out and "all" in out


def test_planted_confident_wrong_token_is_rejected(monkeypatch, capsys, tmp_path, ar_rows):
    dep, rows = ar_rows
    scorer = Scorer(dep.target)
    bad = [dict(r) for r in rows]
    row = bad[0]
    top = [float(scorer.next_logprobs(row["prompt_ids"] + row["output_ids"][:k]).max()) for k in range(1, 20)]
    k = 1 + max(range(len(top)), key=top.__getitem__)  # the position where the target is most confident
    logp = scorer.next_logprobs(row["prompt_ids"] + row["output_ids"][:k])
    assert float(logp.max()) > -0.5  # p(top-1) > 0.6
    wrong = int(torch.argmin(logp))  # the least likely token: margin far above 2δ
    margin = float(logp.max() - logp[wrong])
    row["output_ids"] = row["output_ids"][:k] + [wrong] + row["output_ids"][k + 1 :]
    code, res = audit_json(monkeypatch, capsys, "--outputs", write(tmp_path / "bad.jsonl", bad))
    a = res["audited"]
    assert code == 1 and not res["passed"]
    assert a["events"] >= 1 and a["top_margins"][0] == pytest.approx(margin, abs=1e-3)
    assert a["per_benchmark"][row["benchmark"]]["events"] >= 1
    assert any("events" in r for r in res["reasons"])
    assert all("the scorer's" in r and "stock" not in r for r in res["reasons"])  # the baseline is the scorer
    # the same file against itself as the reference: equal figures, so neither rule fires
    code, res = audit_json(monkeypatch, capsys, "--outputs", str(tmp_path / "bad.jsonl"),
                           "--reference", str(tmp_path / "bad.jsonl"))
    assert code == 0 and res["passed"] and res["baseline"]["events"] == a["events"]
    code, res = audit_json(monkeypatch, capsys, "--outputs", str(tmp_path / "bad.jsonl"),
                           "--reference", write(tmp_path / "ar.jsonl", rows))
    assert code == 1 and all("the reference's" in r and "stock" not in r for r in res["reasons"])
    code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", TARGET, "--outputs", str(tmp_path / "bad.jsonl"))
    assert code == 1 and "REJECTED" in out


@pytest.mark.parametrize("case,needle", [
    ("not_json", "line 2: not JSON"),
    ("missing_key", "line 2: output_ids"),
    ("string_id", "line 2: prompt_ids"),
    ("empty_prompt", "line 2: prompt_ids"),
    ("out_of_vocab", "line 2: output_ids holds id 4096"),
    ("negative", "line 2: prompt_ids holds id -1"),
    ("too_long", "line 2: prompt + output"),
    ("empty_file", "holds no outputs"),
    ("missing_file", "outputs file not found"),
    ("missing_reference", "reference file not found"),
    ("missing_target", "checkpoint directory not found"),
    ("bad_delta", "--delta"),
    ("inf_delta", "--delta must be a finite number"),  # inf would switch the event rule off
])
def test_bad_input_is_one_line_error(monkeypatch, capsys, tmp_path, case, needle):
    good = {"prompt_ids": [5, 6, 7], "output_ids": [8, 9]}
    line2 = {
        "not_json": "{prompt_ids: [1]}", "missing_key": json.dumps({"prompt_ids": [1]}),
        "string_id": json.dumps({"prompt_ids": ["7"], "output_ids": [1]}),
        "empty_prompt": json.dumps({"prompt_ids": [], "output_ids": [1]}),
        "out_of_vocab": json.dumps({"prompt_ids": [1], "output_ids": [4096]}),
        "negative": json.dumps({"prompt_ids": [-1], "output_ids": [1]}),
        "too_long": json.dumps({"prompt_ids": [1] * 2000, "output_ids": [1] * 100}),
    }.get(case, json.dumps(good))
    f = tmp_path / "out.jsonl"
    f.write_text("" if case == "empty_file" else json.dumps(good) + "\n" + line2 + "\n")
    args = ["audit", "--target", TARGET, "--outputs", str(f)]
    if case == "missing_file":
        args[-1] = str(tmp_path / "nope.jsonl")
    if case == "missing_reference":
        args += ["--reference", str(tmp_path / "none.jsonl")]
    if case == "missing_target":
        args[2] = str(tmp_path / "no-target")
    if case in ("bad_delta", "inf_delta"):
        args += ["--delta", "0" if case == "bad_delta" else "inf"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0] and "Traceback" not in err


def test_all_empty_outputs_are_bad_input(monkeypatch, capsys, tmp_path):
    """Outputs with 0 tokens in all give no verdict (a pass would vouch for nothing, a reject would blame an engine
    for a file without its tokens): bad input, one line, exit 2."""
    f = write(tmp_path / "empty.jsonl", [{"prompt_ids": [5, 6, 7], "output_ids": []}] * 2)
    for extra in ((), ("--json",)):
        code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", TARGET, "--outputs", f, *extra)
        assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
        assert err.startswith(f"error: --outputs {f}: all 2 output_ids are empty (0 tokens)"), err


def test_a_reference_without_tokens_is_bad_input(monkeypatch, capsys, tmp_path):
    """Tenth-session fresh-user test: a --reference whose output_ids are all empty passed as a measured 0.00% baseline."""
    ref = write(tmp_path / "empty.jsonl", [{"prompt_ids": [5, 6, 7], "output_ids": []}] * 2)
    outs = write(tmp_path / "outs.jsonl", [{"prompt_ids": [5, 6, 7], "output_ids": [8, 9]}])
    code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", TARGET, "--outputs", outs, "--reference", ref)
    assert code == 2 and "gives no baseline" in err and "Traceback" not in err, err


def test_generate_json_lines_feed_audit(monkeypatch, capsys, tmp_path):
    """``generate --json`` output lines go straight into ``audit --outputs`` (round trip)."""
    lines = []
    for prompt in ("def add(a, b):", "Question: 3 + 4 ="):
        code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", prompt, "--drafter", "ngram",
                                 "--max-new-tokens", "12", "--json")
        assert code == 0, err
        row = json.loads(out)
        assert row["prompt_ids"] and row["output_ids"] == row["tokens"] and len(row["output_ids"]) >= 1
        lines.append(out.strip())
    f = tmp_path / "gen.jsonl"
    f.write_text("\n".join(lines) + "\n")
    code, res = audit_json(monkeypatch, capsys, "--outputs", str(f))
    assert code == 0 and res["passed"] and res["lines"] == 2
    assert res["audited"]["tokens"] == sum(len(json.loads(x)["output_ids"]) for x in lines)
    assert res["audited"]["mismatches"] == 0

"""SystemConfig takes a user's values as given or refuses them (strict fields), and the commands that build one from
user input say why in one ``error:`` line."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specpilot.config import SystemConfig
from specpilot.errors import validation_message

from .conftest import run_cli


@pytest.mark.parametrize("bad", [{"w12": "yes"}, {"tlv": 1}, {"nodes": "6"}, {"nodes": 6.0}, {"depth": True},
                                 {"drafter_block": (6, "4")}, {"drafter_path": 3}])
def test_values_are_never_converted(bad):
    base = {"tree": "best_first", "top_k": 2} if "drafter_block" not in bad else {}
    with pytest.raises(ValidationError) as e:
        SystemConfig(**base, **bad)
    line = validation_message(e.value)
    assert "\n" not in line and line.startswith(f"--{next(iter(bad)).replace('_', '-')}")
    assert validation_message(e.value, flags=False).startswith(next(iter(bad)))


def test_json_round_trip_keeps_working():
    """system.json and memory entries hold JSON: ints, bools and lists for the tuples are read as written."""
    c = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=6, top_k=2, w12=True,
                     row_selection="shared_budget", shared_budget=(5, 9), drafter_block=(6, 4), prompt_admission=16)
    back = SystemConfig(**json.loads(json.dumps(c.model_dump())))
    assert back == c and back.seal() == c.seal() and back.shared_budget == (5, 9)
    assert c.apply({"nodes": 4}).nodes == 4
    with pytest.raises(ValidationError):
        c.apply({"nodes": "4"})


def test_serve_system_file_with_a_string_bool_is_one_line(monkeypatch, capsys, tmp_path):
    f = tmp_path / "system.json"
    f.write_text('{"config": {"drafter": "ngram", "w12": "yes"}, "deployment": {"target": "x"}}')
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "w12: Input should be a valid boolean" in err


def test_calibrate_bad_depth_is_one_line_before_loading(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", "--out", str(tmp_path / "cal.json"), "--depth", "100")
    assert code == 2 and err.startswith("error: invalid option: --depth") and err.count("\n") == 1, err

"""The pilot's cost-model pieces on a tiny hybrid (Gated DeltaNet) target, CPU float32: the exact pass is timed by rows
(with and without a drafter's feature layers) and a path move is timed; TLV is not priced on a target without a Q view
(said in one line, None), so the pilot runs on. ``specpilot pilot --quick`` itself was run on a tiny hybrid by hand
(docs/hybrid.md), not here: it takes minutes."""

from __future__ import annotations

from types import SimpleNamespace

from specpilot.pilot.costinputs import tlv_inputs
from specpilot.pilot.setup import measure_move_ms, measure_verify_ms

from .hybridutil import LAYERS, tiny_target


def test_verify_and_move_timed_on_a_hybrid():
    target = tiny_target()
    for layers in ((), LAYERS):
        ms = measure_verify_ms(target, prefix_len=20, rows=(1, 4), repeats=1, feature_layers=layers)
        assert set(ms) == {1, 4} and all(v > 0 for v in ms.values())
    moves = measure_move_ms(target, prefix_len=20, lengths=(2, 3), repeats=1, feature_layers=LAYERS)
    assert set(moves) == {2, 3} and all(v >= 0 for v in moves.values())


def test_tlv_not_priced_on_a_hybrid():
    said = []
    from specpilot.model.qview import q_view

    dep = SimpleNamespace(target=tiny_target(), q_target=q_view)  # the deployment's Q view: q_view, which refuses
    pilot = SimpleNamespace(dep=dep, say=lambda phase, msg: said.append(msg))
    assert tlv_inputs(pilot, {}, 4, False) is None
    assert said == ["TLV not priced: TLV's Q pass is not built for hybrid (Gated DeltaNet) targets yet"]

"""Public EAGLE-3 checkpoints: our loader reproduces the logits the public reference implementation gives for the
same tiny checkpoint (values made by ``tests/data/eagle3_ref/make_reference.py``), and malformed checkpoints are
refused with one clear line. float32 CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpilot.errors import DrafterError
from specpilot.model.checkpoint import load_model
from specpilot.spec.drafter import DraftRequest
from specpilot.spec.eagle3 import Eagle3Drafter, is_eagle3_dir, load_eagle3

from .conftest import save_tiny

REF_DIR = Path(__file__).parent / "data" / "eagle3_ref"
TOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    return json.loads((REF_DIR / "reference.json").read_text())


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer llama target of hidden 32 / vocab 64 (aux ids 1, 2, 3 -> our layers 0, 1, 2)."""
    d = save_tiny(tmp_path_factory.mktemp("e3t") / "t", model_type="llama", vocab=64, hidden=32, layers=4, seed=3)
    return load_model(d)


def _steps(net, ref, embed=None):
    """Steps A, B, C of the reference run through our network's pieces: logits ``[7, Vd]``, ``[2, Vd]``, ``[1, Vd]``."""
    feats = torch.tensor(ref["features"])
    emb = lambda t: net.embed(torch.tensor(t), embed)  # noqa: E731
    q, k, v, res = net.project(emb(ref["tokens"]), net.fuse(feats), torch.arange(7))
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None]
    out_a = net.finish(net.attend(q[None], k[None], v[None], causal), res[None])[0]
    qb, kb, vb, rb = net.project(emb(ref["b_tokens"]), out_a[-1:].expand(2, -1), torch.tensor([7, 7]))
    keys, vals = torch.cat((k, kb))[None], torch.cat((v, vb))[None]
    mask_b = torch.ones(1, 2, 9, dtype=torch.bool)
    mask_b[0, 0, 8] = mask_b[0, 1, 7] = False
    out_b = net.finish(net.attend(qb[None], keys, vals, mask_b), rb[None])[0]
    qc, kc, vc, rc = net.project(emb([ref["c_token"]]), out_b[:1], torch.tensor([8]))
    keys, vals = torch.cat((k, kb, kc))[None], torch.cat((v, vb, vc))[None]
    mask_c = torch.tensor([[[True] * 7 + [True, False, True]]])
    out_c = net.finish(net.attend(qc[None], keys, vals, mask_c), rc[None])[0]
    return out_a, [net.draft_logits(o) for o in (out_a, out_b, out_c)]


def test_loader_reproduces_reference_logits(target, ref):
    assert is_eagle3_dir(REF_DIR)
    net = load_eagle3(REF_DIR, target)
    assert net.cfg.target_layers == [0, 1, 2] and net.cfg.own_embedding and net.cfg.draft_vocab_size == 48
    out_a, (la, lb, lc) = _steps(net, ref)
    assert (out_a[-1] - torch.tensor(ref["prenorm_a_last"])).abs().max() < TOL
    for ours, key in ((la, "logits_a"), (lb, "logits_b"), (lc, "logits_c")):
        assert (ours - torch.tensor(ref[key])).abs().max() < TOL, key
    top2 = la[-1].topk(2).indices
    assert net.to_target(top2).tolist() == ref["b_tokens"]
    full = net.target_logits(out_a[-1:])  # -inf outside the draft vocabulary
    assert torch.isinf(full).sum() == 64 - 48 and full.argmax().item() == ref["b_tokens"][0]


def test_drafter_lattice_matches_reference(target, ref):
    """The drafter's own path (observe, committed rows, tree rows with their ancestors) gives the reference's
    log-probs: root children from A's last row, children of B's rows, and of C."""
    net = load_eagle3(REF_DIR, target)
    d = Eagle3Drafter(net, target, top_k=2, expand=4, max_slots=2)
    committed = [5] + ref["tokens"]  # row j reads token j + 1 and feature j
    feats = torch.tensor(ref["features"])
    net_in = torch.zeros(7, 3 * 32)
    net_in[:] = feats
    d.observe(1, net_in[:4], 0)
    d.observe(1, net_in[4:], 4)
    lat = d.propose([DraftRequest(1, committed, 3)])[0]
    lsm = lambda x: torch.tensor(x).log_softmax(-1)  # noqa: E731

    def check(path, logits):
        lp, ids = lsm(logits).topk(2)
        kids = lat.children(path)
        assert [t for t, _ in kids] == net.to_target(ids).tolist(), path
        assert max(abs(a - b) for (_, a), b in zip(kids, lp.tolist())) < TOL, path

    check((), ref["logits_a"][-1])
    b0, b1 = ref["b_tokens"]
    check((b0,), ref["logits_b"][0])
    check((b1,), ref["logits_b"][1])
    check((b0, ref["c_token"]), ref["logits_c"][0])


def test_shared_embedding_when_absent(target, ref, tmp_path):
    """Without embed_tokens the target's embedding is read (as vLLM shares it): same logits when the tables agree."""
    sd = load_file(str(REF_DIR / "model.safetensors"))
    table = sd.pop("embed_tokens.weight")
    shutil.copy(REF_DIR / "config.json", tmp_path / "config.json")
    save_file(sd, str(tmp_path / "model.safetensors"))
    net = load_eagle3(tmp_path, target)
    assert not net.cfg.own_embedding
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(table)
    _, (la, _, _) = _steps(net, ref, target.model.embed_tokens)
    assert (la - torch.tensor(ref["logits_a"])).abs().max() < TOL


def _broken(tmp_path, cfg_edit=None, sd_edit=None):
    raw = json.loads((REF_DIR / "config.json").read_text())
    sd = load_file(str(REF_DIR / "model.safetensors"))
    if cfg_edit:
        cfg_edit(raw)
    if sd_edit:
        sd_edit(sd)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("case, cfg_edit, sd_edit, words", [
    ("missing key", None, lambda sd: sd.pop("midlayer.hidden_norm.weight"), "lacks the tensor"),
    ("missing d2t", None, lambda sd: sd.pop("d2t"), "lacks the tensor 'd2t'"),
    ("extra layer", None, lambda sd: sd.update({"layers.1.mlp.up_proj.weight": torch.zeros(2)}), "does not have"),
    ("wrong shape", None, lambda sd: sd.update({"fc.weight": torch.zeros(32, 64)}), "has shape"),
    ("no hidden_size", lambda c: c.pop("hidden_size"), None, "lacks the field 'hidden_size'"),
    ("two layers", lambda c: c.update(num_hidden_layers=2), None, "one-layer"),
    ("aux ids", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}), None, "aux layer"),
    ("vocab", lambda c: c.update(vocab_size=100), None, "vocab"),
    ("d2t range", None, lambda sd: sd["d2t"].add_(60), "d2t maps"),
    ("t2d", None, lambda sd: sd["t2d"].fill_(True), "t2d disagrees"),
    ("rope", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 2.0}), None, "rope"),
])
def test_malformed_checkpoints_refused(target, tmp_path, case, cfg_edit, sd_edit, words):
    p = _broken(tmp_path, cfg_edit, sd_edit)
    with pytest.raises(DrafterError) as e:
        load_eagle3(p, target)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, (case, msg)


def test_not_an_eagle3_dir(target, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DrafterError, match="not an eagle3 drafter"):
        load_eagle3(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"specpilot_drafter": "eagle3"}))
    with pytest.raises(DrafterError, match="lacks the field"):
        load_eagle3(tmp_path, target)

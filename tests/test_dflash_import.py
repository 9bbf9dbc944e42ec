"""Public DFlash drafter checkpoints loaded as our block drafter: the logits of the public reference implementation
reproduced on a tiny checkpoint, malformed checkpoints refused in one line, spec == AR with a loaded drafter.
float32 CPU."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.errors import DrafterError
from specpilot.model.args import ModelArgs
from specpilot.model.transformer import Transformer
from specpilot.spec.block import BlockDrafter, is_block_dir, load_block
from specpilot.spec.block_net import BlockNet
from specpilot.spec.dflash_import import default_layer_ids, load_dflash
from specpilot.spec.drafter import propose_one

from .conftest import random_prompts
from .dflashutil import REF, REF_CASES, ref_features, ref_target_weights, write_dflash, write_ref
from .test_engine import ar_tokens

REFERENCE = Path(__file__).parent / "data" / "dflash_reference.json"


@pytest.fixture(scope="module")
def ref_target():
    """A 4-layer target (hidden 64, vocabulary 256) whose embedding and LM head are the reference's."""
    torch.manual_seed(0)
    t = Transformer(ModelArgs("qwen3", REF["vocab"], REF["hidden"], 128, REF["num_target_layers"], 4, 2, 16,
                              qk_norm=True)).eval().requires_grad_(False)
    embed, head = ref_target_weights()
    t.model.embed_tokens.weight.copy_(embed)
    t.lm_head.weight.copy_(head)
    return t


def _drafted(net, target):
    """Per reference case, our drafter's block logits ``[B - 1, vocab]`` (the context observed incrementally)."""
    d, feats, start, out = BlockDrafter(net, target), ref_features(), 0, []
    for c, anchor in REF_CASES:
        d.observe(0, feats[start:c], start)
        start = c
        out.append(d.block_logits([1] * c + [anchor]))
    return out


def test_reference_logits_reproduced(tmp_path, ref_target):
    ref = json.loads(REFERENCE.read_text())
    path = write_ref(tmp_path / "dflash")
    assert is_block_dir(path)
    net = load_block(path, ref_target)  # dispatched to the DFlash loader
    assert net.cfg.block_size == REF["block"] - 1 and net.cfg.diffusion_block and not net.cfg.ctx_layer_norm
    for got, case in zip(_drafted(net, ref_target), ref["cases"], strict=True):
        want = torch.tensor(case["logits"])
        assert got.shape == want.shape == (REF["block"] - 1, REF["vocab"])
        assert (got - want).abs().max().item() < 1e-4
        assert got.argmax(-1).tolist() == case["argmax"]
    # each option matters: without it the logits are far from the reference's
    for off in ({"ctx_layer_norm": True}, {"diffusion_block": False}):
        other = BlockNet(dataclasses.replace(net.cfg, **off)).eval()
        other.load_state_dict(net.state_dict())
        got = _drafted(other, ref_target)[0][: 6]
        assert (got - torch.tensor(ref["cases"][0]["logits"])[: 6]).abs().max().item() > 1e-2, off


def test_reference_logits_through_the_static_step(tmp_path, ref_target):
    """The drafter's static step (the CUDA-graph form, run eagerly here) gives the reference's log-probs."""
    d = BlockDrafter(load_block(write_ref(tmp_path / "dflash"), ref_target), ref_target, static_step=True)
    _check_static_step(d, ref_features(), argmax=True)


def _check_static_step(d, feats, argmax: bool) -> None:
    """Observe the reference cases' contexts one after another; each lattice's log-probs (and, with ``argmax``, its
    best candidates) are the reference's."""
    ref, start = json.loads(REFERENCE.read_text()), 0
    for (c, anchor), case in zip(REF_CASES, ref["cases"], strict=True):
        d.observe(0, feats[start:c], start)
        start = c
        want = torch.tensor(case["logits"]).log_softmax(-1)
        lat, path = propose_one(d, [1] * c + [anchor], REF["block"] - 1), ()
        for i in range(REF["block"] - 1):
            cands = lat.children(path)
            if argmax:
                assert cands[0][0] == case["argmax"][i]
            assert max(abs(lp - want[i, t].item()) for t, lp in cands) < 1e-4
            path += (cands[0][0],)


def test_sharded_checkpoint_and_default_layers(tmp_path, ref_target):
    one = load_dflash(write_ref(tmp_path / "one"), ref_target)
    three = load_dflash(write_ref(tmp_path / "three", shards=3), ref_target)
    for k, v in one.state_dict().items():
        assert torch.equal(three.state_dict()[k], v), k
    assert torch.equal(one.mask_embed, ref_target.model.embed_tokens.weight[REF["mask_token_id"]])
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33] and default_layer_ids(36, 1) == [18]

    def no_ids(cfg, sd):
        del cfg["dflash_config"]["target_layer_ids"]
    # a 2-layer drafter of a 4-layer target reads layers 1 and 1 by DFlash's default rule
    assert load_dflash(write_ref(tmp_path / "default", edit=no_ids), ref_target).cfg.target_layers == [1, 1]


def _set(path, value):
    def edit(cfg, sd):
        *keys, last = path
        d = cfg
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


def _del_weight(cfg, sd):
    del sd["layers.1.mlp.up_proj.weight"]


def _bad_shape(cfg, sd):
    sd["fc.weight"] = sd["fc.weight"][:, :64].contiguous()


def _extra_weight(cfg, sd):
    sd["layers.2.self_attn.q_proj.weight"] = sd["layers.1.self_attn.q_proj.weight"].clone()


def _no_mask(cfg, sd):
    del cfg["dflash_config"]["mask_token_id"]


MALFORMED = [
    (_del_weight, "misses 1 weight"),
    (_bad_shape, "has shape"),
    (_extra_weight, "unexpected weight"),
    (_set(["hidden_size"], 128), "hidden 128"),
    (_set(["vocab_size"], 300), "vocab 300"),
    (_set(["dflash_config", "target_layer_ids"], [0, 4]), "reads target layers"),
    (_set(["dflash_config", "target_layer_ids"], [0, 3]), "final-normed"),
    (_set(["num_target_layers"], 36), "target of 36 layers"),
    (_no_mask, "mask_token_id"),
    (_set(["dflash_config", "mask_token_id"], 999), "outside the target's vocabulary"),
    (_set(["layer_types"], ["sliding_attention", "full_attention"]), "sliding-window"),
    (_set(["block_size"], 1), "block_size"),
    (_set(["num_key_value_heads"], 3), "key/value heads"),
]


@pytest.mark.parametrize("edit,message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_checkpoints_refused(tmp_path, ref_target, edit, message):
    with pytest.raises(DrafterError, match=message) as e:
        load_block(write_ref(tmp_path / "bad", edit=edit), ref_target)
    assert "\n" not in str(e.value)


def test_missing_or_corrupt_files_refused(tmp_path, ref_target):
    d = write_ref(tmp_path / "sharded", shards=2)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(DrafterError, match="missing"):
        load_dflash(d, ref_target)
    d = write_ref(tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DrafterError, match="not a readable safetensors"):
        load_dflash(d, ref_target)
    (d / "model.safetensors").unlink()
    with pytest.raises(DrafterError, match="no model.safetensors"):
        load_dflash(d, ref_target)


@pytest.fixture(scope="module")
def bundled_dflash(tmp_path_factory):
    """``(target dir, DFlash dir)``: the bundled target and a random DFlash drafter of its shape (block 8)."""
    from specpilot.zoo import bundled_target_dir

    t = bundled_target_dir()
    if not (t / "model.safetensors").is_file():
        pytest.skip("bundled target not built")
    a = json.loads((t / "config.json").read_text())
    d = write_dflash(tmp_path_factory.mktemp("bundled") / "dflash", hidden=a["hidden_size"], layers=1,
                     heads=a["num_attention_heads"], kv_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
                     intermediate=a["hidden_size"], vocab=a["vocab_size"], block=8, target_layers=[1, 3],
                     num_target_layers=a["num_hidden_layers"], mask_token_id=5, rope_theta=a.get("rope_theta", 1e4),
                     seed=3)
    return t, d


def test_spec_equals_ar_bundled_target(bundled_dflash):
    """A random DFlash drafter of the bundled target's shape, given as the drafter path: chain and best_first
    (eager, and with row buckets + the drafter's static step) equal AR greedy token for token."""
    dep = Deployment(*bundled_dflash, dtype="float32")
    assert dep.draft_model is None and dep.block_net().cfg.diffusion_block
    prompts = random_prompts(2, vocab=dep.target.args.vocab_size, length=10, seed=7)
    for tree, nodes, buckets in (("chain", 7, False), ("best_first", 16, False), ("best_first", 16, True)):
        eng = dep.system(SystemConfig(drafter="block", tree=tree, nodes=nodes, depth=7, top_k=4), eos_ids=[],
                         buckets=buckets)  # buckets: row buckets + the drafter's static step (eager on the CPU)
        for p in prompts[: 1 if buckets else 2]:
            gen = eng.generate(p, 20)
            assert gen.tokens == ar_tokens(dep.target, p, 20), (tree, buckets)
            assert max(gen.rows) <= nodes + 1
    with pytest.raises(DrafterError, match="at most 7 positions"):
        dep.system(SystemConfig(drafter="block", tree="chain", nodes=8, depth=8, top_k=4))


def test_cli_drafter_path(monkeypatch, capsys, bundled_dflash, tmp_path):
    """``generate --drafter block --drafter-path <DFlash dir>`` equals AR; the wrong kind or a malformed
    checkpoint is one line and exit 2."""
    from .conftest import run_cli

    t, d = (str(x) for x in bundled_dflash)
    base = ["generate", "--prompt", "Question: 3 + 4 =", "--target", t, "--max-new-tokens", "12", "--json"]
    code, out, err = run_cli(monkeypatch, capsys, *base, "--drafter", "none")
    assert code == 0, err
    ar = json.loads(out)["tokens"]
    code, out, err = run_cli(monkeypatch, capsys, *base, "--drafter", "block", "--drafter-path", d, "--tree",
                             "best_first", "--nodes", "8", "--depth", "7")
    assert code == 0, err
    assert json.loads(out)["tokens"] == ar
    code, _, err = run_cli(monkeypatch, capsys, *base, "--drafter", "draft_model", "--drafter-path", d)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "use --drafter block" in err, err
    bad = write_ref(tmp_path / "bad", edit=_del_weight)
    code, _, err = run_cli(monkeypatch, capsys, *base, "--drafter", "block", "--drafter-path", str(bad))
    assert code == 2 and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_step_on_cuda(tmp_path, ref_target, bundled_dflash):
    """On a GPU: the static step captured as a CUDA graph gives the reference log-probs, and float32 spec with row
    buckets + graphed drafter steps equals AR on the bundled target."""
    target = copy.deepcopy(ref_target).cuda()
    d = BlockDrafter(load_block(write_ref(tmp_path / "dflash"), target), target, static_step=True)
    _check_static_step(d, ref_features().cuda(), argmax=False)
    dep = Deployment(*bundled_dflash, dtype="float32", device="cuda")
    ar = dep.system(SystemConfig.ar(), eos_ids=[], buckets=False)
    eng = dep.system(SystemConfig(drafter="block", tree="best_first", nodes=32, depth=7, top_k=8), eos_ids=[])
    for p in random_prompts(2, vocab=dep.target.args.vocab_size, length=12, seed=7):
        assert eng.generate(p, 32).tokens == ar.generate(p, 32).tokens

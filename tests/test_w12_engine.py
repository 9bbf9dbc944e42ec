"""The ``w12`` engine mechanism (§4.1): SystemConfig field, the target's projections in W12, AR and
speculative decoding, and W12 checkpoint directories loaded by ``load_model``.

Why float32 on the CPU is a meaningful test: the bundled target is a bf16 checkpoint, so loaded in float32
its weights are bf16 values and W12 holds them exactly. On the CPU a W12 layer decodes and runs the very
``F.linear`` call ``nn.Linear`` runs, so the w12 model must give *bitwise* the plain model's logits, and
speculative output with w12 must equal AR output with w12 (and the plain AR output). The Triton kernel path
(interpreter) is tested through the fused static engine path on a tiny model with bf16-valued weights.
"""

from __future__ import annotations

import shutil

import pytest

from specpilot.model.transformer import KernelConfig
import torch
from safetensors.torch import load_file, save_file

from .tritonutil import DEV

from specpilot.config import SystemConfig
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.model.checkpoint import load_model
from specpilot.engine.deployment import Deployment
from specpilot.engine.engine import Engine
from specpilot.errors import CheckpointError
from specpilot.w12.linear import W12Linear
from specpilot.w12.convert import is_w12, to_w12, w12_head
from specpilot.w12.format import W12FormatError
from specpilot.w12.pack import pack_dir
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .conftest import random_prompts

PROJ = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("w12eng") / "target"
    pack_dir(bundled_target_dir(), out)
    return out


def prompts(dep, n=2):
    texts = ["def fibonacci(n):\n    ", "Question: Tom has 3 apples and buys 5 more. How many"][:n]
    return [dep.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_config_field_label_seal_and_old_configs():
    old = {"drafter": "ngram", "drafter_path": None, "tree": "best_first", "nodes": 16, "depth": 10, "top_k": 4,
           "ngram_max": 4, "ngram_min": 1, "dtype": "float32"}
    cfg = SystemConfig(**old)  # a config stored before the field existed
    assert cfg.w12 is False
    # its seal as recorded in results/pilot_cpu_bundled_2026-11-30/system.json
    assert cfg.seal() == "4ce261a774d2041300beb3f5ce0164826f7bb232bb0fd98056778e8ad51f3820"
    on = cfg.apply({"w12": True})
    assert on.seal() != cfg.seal() and on.delta(cfg) == {"w12": True}
    assert on.label() == "ngram/best_first N=16 D=10 k=4 +w12" and SystemConfig.ar(w12=True).label() == "AR +w12"
    assert SystemConfig(**on.model_dump()).seal() == on.seal()


def test_to_w12_replaces_projections_only_and_shares_the_rest(dep):
    plain = dep.target
    w = dep.w12_target()
    assert dep.w12_target() is w and is_w12(w) and not is_w12(plain)
    for layer_p, layer_w in zip(plain.model.layers, w.model.layers):
        for name in PROJ:
            a, b = layer_p.get_submodule(name), layer_w.get_submodule(name)
            assert isinstance(a, torch.nn.Linear) and isinstance(b, W12Linear)
            assert torch.equal(b.decoded_weight().float(), a.weight)
        assert layer_w.input_layernorm.weight is layer_p.input_layernorm.weight
        assert layer_w.self_attn.q_norm.weight is layer_p.self_attn.q_norm.weight
    assert w.lm_head.weight is plain.lm_head.weight and w.model.embed_tokens is plain.model.embed_tokens
    w12_bytes = sum(b.numel() for m in w.modules() if isinstance(m, W12Linear) for b in m.buffers())
    lin_w = sum(plain.model.layers[i].get_submodule(n).weight.numel() for i in range(len(plain.model.layers)) for n in PROJ)
    assert w12_bytes / lin_w < 1.6  # 12-bit records + bases + escape tables: about 1.5 bytes a weight


def test_w12_target_logits_bitwise_equal_plain_in_float32(dep):
    ids = torch.tensor(prompts(dep, 1)[0])
    out = []
    for model in (dep.target, dep.w12_target()):
        cache = model.new_cache(64)
        with torch.inference_mode():
            out.append(model.logits(model.forward(ids, torch.arange(len(ids)), cache, 0)))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("cfg", [
    SystemConfig.stock("ngram", w12=True),
    SystemConfig(drafter="ngram", tree="best_first", nodes=16, depth=8, top_k=4, w12=True),
    SystemConfig.stock("draft_model", w12=True),
    SystemConfig(drafter="draft_model", tree="best_first", nodes=16, depth=6, top_k=4, w12=True),
], ids=lambda c: c.label())
def test_spec_equals_ar_with_w12_on_bundled_target(dep, cfg):
    for ids in prompts(dep):
        ar = dep.system(SystemConfig.ar(w12=True)).generate(ids, 32)
        eng = dep.system(cfg)
        assert eng.target is dep.w12_target()
        assert eng.generate(ids, 32).tokens == ar.tokens, cfg.label()
        assert ar.tokens == dep.system(SystemConfig.ar()).generate(ids, 32).tokens


def test_w12_kernel_in_fused_engine_equals_ar(tiny_dirs):
    """The Triton W12 GEMM (interpreter) inside the fused static path with padded buckets: speculative
    output == AR output, both through the kernel, == the plain model's AR output."""
    target, drafter = load_model(tiny_dirs[0], device=DEV), load_model(tiny_dirs[1], device=DEV)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # a bf16-valued target (W12 is for bf16 weights)
    w12 = to_w12(target)
    layers = [m for m in w12.modules() if isinstance(m, W12Linear)]
    assert len(layers) == 9 and w12_head(w12)  # 2 layers x 4 projections + the untied head
    calls = []
    for m in layers:
        m.use_kernel = True
        real = m.forward
        m.forward = lambda x, real=real: calls.append(x.shape[0]) or real(x)
    cfg = SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, w12=True)
    w12.kernels = KernelConfig(fused=True)
    for p in random_prompts(2, 64, length=8, seed=23):
        spec = Engine(w12, cfg, DraftModelDrafter(drafter, 2), eos_ids=[], buckets=True).generate(p, 8).tokens
        ar = Engine(w12, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        plain = Engine(target, SystemConfig.ar(), None, eos_ids=[]).generate(p, 8).tokens
        assert spec == ar == plain
    assert calls and max(calls) > 1 and 1 in calls


def _bf16_valued(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def test_untied_head_becomes_w12_tied_head_stays(dep, tiny_dirs):
    plain = _bf16_valued(load_model(tiny_dirs[0], device=DEV))
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    w = to_w12(plain)
    assert w12_head(w) and not w12_head(plain) and isinstance(plain.lm_head, torch.nn.Linear)
    assert torch.equal(w.lm_head.decoded_weight().float(), plain.lm_head.weight)
    assert w.device == plain.device and w.dtype == plain.dtype
    kept = to_w12(plain, head=False)
    assert not w12_head(kept) and kept.lm_head is plain.lm_head and is_w12(kept)
    ids = torch.tensor(random_prompts(1, 64, length=10, seed=5)[0], device=DEV)
    for m in (*w.modules(), *kept.modules()):
        if isinstance(m, W12Linear):
            m.use_kernel = False  # the reference path on a GPU too (the kernel sums in another order)
    logits = []
    for model in (plain, w, kept):
        with torch.inference_mode():
            logits.append(model.logits(model.forward(ids, torch.arange(len(ids), device=DEV), model.new_cache(32), 0)))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])  # reference path: bitwise
    tied = dep.w12_target()  # the bundled target ties its head to the embeddings: left as it is
    assert not w12_head(tied) and tied.lm_head.weight is dep.target.model.embed_tokens.weight


def test_w12_head_with_int8_head_in_a_deployment(tiny_dirs, tmp_path):
    """An untied target with ``w12`` and ``lm_head_int8`` on: the W12 target carries a W12 head, the INT8
    system puts the bf16 head back under the certified head; every system gives the AR tokens."""
    src = tmp_path / "t"
    shutil.copytree(tiny_dirs[0], src)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, src / "model.safetensors")  # a bf16 checkpoint (loaded in float32 below)
    d = Deployment(src, tiny_dirs[1])
    assert w12_head(d.w12_target())
    with pytest.raises(Exception, match="needs the bf16 LM head"):
        from specpilot.head.certified import with_int8_head
        with_int8_head(d.w12_target())
    for ids in random_prompts(2, 64, length=8, seed=29):
        ar = d.system(SystemConfig.ar()).generate(ids, 12).tokens
        for cfg in (SystemConfig.ar(w12=True), SystemConfig.ar(w12=True, lm_head_int8=True),
                    SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2, w12=True,
                                 lm_head_int8=True)):
            eng = d.system(cfg)
            assert w12_head(eng.target) != cfg.lm_head_int8
            assert eng.generate(ids, 12).tokens == ar, cfg.label()


def test_w12_refuses_non_bf16_target(tiny_dirs):
    target = load_model(tiny_dirs[0])  # a float32 checkpoint: its weights are not bf16 values
    with pytest.raises(W12FormatError, match="bfloat16"):
        to_w12(target)
    assert not is_w12(target)  # left as it was


def test_to_w12_takes_a_model_and_names_nan_weights(tiny_dirs):
    """A fresh user's calls: ``to_w12(nn.Linear)`` was an AttributeError; a float32 NaN that bf16 cannot hold was
    "not bfloat16 values". A NaN or inf that is a bf16 value (a bf16 checkpoint's, loaded in float32) stays, bit for
    bit, as W12 keeps a bf16 weight's (the kernels' non-finite tests)."""
    from torch import nn

    from specpilot.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="to_w12 takes a model .* not Linear: encode one layer with W12Linear"):
        to_w12(nn.Linear(8, 8))
    layer = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.to(torch.bfloat16).float())
        layer.weight[1, 3], layer.weight[2, 5], layer.weight[3, 7] = float("nan"), float("inf"), -float("nan")
    got = W12Linear.from_linear(layer).w12()
    from specpilot.w12.format import decode

    assert torch.equal(decode(got).float().view(torch.int32), layer.weight.detach().view(torch.int32))
    with torch.no_grad():
        layer.weight.view(torch.int32)[4, 1] = 0x7F800001  # a NaN whose payload lies in bits bf16 drops
    with pytest.raises(W12FormatError, match=r"1 NaN value\(s\) whose bits are not a bfloat16 NaN \(the first at \[4"):
        W12Linear.from_linear(layer)
    with torch.no_grad():
        layer.weight[4, 1] = 0.1
    with pytest.raises(W12FormatError, match=r"values that are not bfloat16 values \(the first at \[4, 1\]: 0.1"):
        W12Linear.from_linear(layer)
    target = load_model(tiny_dirs[0])
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        target.lm_head.weight[0, 0] = float("nan")  # the head of the fresh user's call
    assert w12_head(to_w12(target))


def test_load_model_reads_w12_dir_like_its_source(packed):
    src = load_model(bundled_target_dir(), dtype="bfloat16")
    got = load_model(packed, dtype="bfloat16")
    a, b = src.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k
    ids = torch.tensor([5, 17, 300, 42, 7, 99])
    logits = []
    for model in (src, got):
        with torch.inference_mode():
            logits.append(model.logits(model.forward(ids, torch.arange(6), model.new_cache(16), 0)))
    assert torch.equal(logits[0], logits[1])
    dp = Deployment(packed, bundled_drafter_dir())
    ids = [5, 17, 300, 42, 7, 99]
    assert dp.system(SystemConfig.stock("draft_model", w12=True)).generate(ids, 16).tokens == \
        Deployment(bundled_target_dir()).system(SystemConfig.ar()).generate(ids, 16).tokens


def test_corrupted_w12_dir_is_a_clear_checkpoint_error(packed, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(packed, d)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.3.self_attn.o_proj.weight.w12.records"
    tensors[key][0, 1, 100] ^= 0x21
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match=r"W12 checkpoint .*bad.*o_proj.*sha256"):
        load_model(d)
    (d / "w12.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(d)

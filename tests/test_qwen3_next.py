"""qwen3_next targets (Gated DeltaNet + gated attention, mixture-of-experts MLPs) on the CPU in float32: logits equal
transformers' own Qwen3NextForCausalLM on a tiny random config, for a prompt (recurrent and chunked prefill) and token
by token; the router, the grouped GDN projections and the dense / sparse layer choice match transformers'."""

import json

import pytest
import torch

from specpilot.errors import CheckpointError
from specpilot.model.cache import PassKind
from specpilot.model.checkpoint import load_model, read_args
from specpilot.model.gdn import split_grouped_projections
from specpilot.model.layers import MLP
from specpilot.model.moe import SparseMoE

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock  # noqa: E402

from .test_hybrid import incremental_max_diff  # noqa: E402

#: 3 GDN + 1 attention layers; 6 experts, top-2, a shared expert; layer 2 keeps a dense MLP
TINY_NEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                 num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 mlp_only_layers=[2], max_position_embeddings=512, eos_token_id=None, tie_word_embeddings=False)


def tiny_next(path, seed: int = 0, **over):
    """Write a tiny random qwen3_next checkpoint to ``path`` (every parameter perturbed, so zero-centred norms, the
    router, the shared expert's gate and the GDN gates are exercised); returns transformers' model (float32,
    eval)."""
    torch.manual_seed(seed)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**{**TINY_NEXT, **over})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            big = "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith("mlp.gate.weight")
            p.add_(torch.randn_like(p) * (0.3 if big else 0.05))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    hf = tiny_next(path)
    return hf, load_model(path, dtype="float32"), path


def prompt_logits(model, ids):
    return model.logits(model.forward(ids, torch.arange(len(ids)), model.new_cache(len(ids) + 8), 0))


@torch.no_grad()
def test_layers_are_moe_where_transformers_puts_them(pair):
    hf, ours, _ = pair
    a = ours.args
    assert a.model_type == "qwen3_next" and a.is_hybrid and a.partial_rotary_factor == 0.25
    assert (a.num_experts, a.num_experts_per_tok, a.mlp_only_layers) == (6, 2, [2])
    for theirs, mine in zip(hf.model.layers, ours.model.layers):
        assert isinstance(theirs.mlp, Qwen3NextSparseMoeBlock) == isinstance(mine.mlp, SparseMoE)
    assert [isinstance(m.mlp, SparseMoE) for m in ours.model.layers] == [True, True, False, True]
    # decoder_sparse_step = 2: only layers 1 and 3 (1-based 2 and 4) are sparse, and mlp_only_layers wins over it
    cfg = Qwen3NextConfig(**{**TINY_NEXT, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    from specpilot.model.args import ModelArgs

    args = ModelArgs.from_hf(cfg.to_dict())
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@torch.no_grad()
def test_router_and_block_equal_transformers(pair):
    hf, ours, _ = pair
    x = torch.randn(9, TINY_NEXT["hidden_size"], generator=torch.Generator().manual_seed(1))
    block, mine = hf.model.layers[0].mlp, ours.model.layers[0].mlp
    _, ref_w, ref_idx = block.gate(x)
    w, idx = mine.route(x)
    assert torch.equal(idx, ref_idx)
    assert (w - ref_w).abs().max().item() < 1e-6 and torch.allclose(w.sum(-1), torch.ones(9))
    assert (mine(x) - block(x[None])[0]).abs().max().item() < 1e-5
    assert 2 <= mine.experts_touched(x) <= 6


@torch.no_grad()
def test_grouped_projections_split_like_transformers(pair):
    """Our split of in_proj_qkvz / in_proj_ba gives the q, k, v, z, b, a transformers' GDN derives."""
    hf, _, _ = pair
    gdn = hf.model.layers[0].linear_attn
    x = torch.randn(1, 5, TINY_NEXT["hidden_size"], generator=torch.Generator().manual_seed(2))
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    qkv_w, z_w, b_w, a_w = split_grouped_projections(gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight, 2, 4, 8, 16)
    ref_qkv = torch.cat([t.reshape(1, 5, -1) for t in (q, k, v)], dim=-1)
    for mine, ref in ((x @ qkv_w.t(), ref_qkv), (x @ z_w.t(), z.reshape(1, 5, -1)), (x @ b_w.t(), b),
                      (x @ a_w.t(), a)):
        assert (mine - ref).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="do not fit"):
        split_grouped_projections(gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight, 2, 4, 8, 8)


@torch.no_grad()
@pytest.mark.parametrize("n,mode", [(23, "snapshot"), (150, "snapshot"), (150, "replay")])
def test_prompt_logits_equal_transformers(pair, n, mode):
    """23 tokens; 150 tokens run step by step (snapshot) and by the chunked prefill (replay keeps one state)."""
    hf, ours, _ = pair
    ids = torch.randint(0, TINY_NEXT["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
    ref = hf(ids[None]).logits[0]
    ours.verify = mode
    try:
        got = prompt_logits(ours, ids)
    finally:
        ours.verify = "snapshot"
    assert (got - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_incremental_logits_equal_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, TINY_NEXT["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    assert incremental_max_diff(hf, ours, ids) < 1e-4


@torch.no_grad()
def test_tree_rows_equal_their_chains(pair):
    """Each tree row's logits (routed experts chosen per row) equal those of its root path run as a chain."""
    _, ours, _ = pair
    prompt = torch.randint(0, TINY_NEXT["vocab_size"], (9,), generator=torch.Generator().manual_seed(4))
    toks, parents = torch.tensor([int(prompt[-1]), 5, 7, 11, 13]), [-1, 0, 0, 2, 3]
    anc = torch.zeros(5, 5, dtype=torch.bool)
    for j in range(5):
        i = j
        while i >= 0:
            anc[j, i], i = True, parents[i]
    cache = ours.new_cache(32)
    ours.forward(prompt[:8], torch.arange(8), cache, 0)
    cache.commit(8)
    mask = torch.cat((torch.ones(5, 8, dtype=torch.bool), anc), dim=1)
    tree = ours.logits(ours.forward(toks, 8 + anc.sum(1) - 1, cache, 8, mask))
    for j in range(5):
        full = torch.cat((prompt[:8], toks[anc[j]]))
        chain = ours.logits(ours.forward(full, torch.arange(len(full)), ours.new_cache(32), 0, kind=PassKind.INSPECT))
        assert (chain[-1] - tree[j]).abs().max().item() < 1e-4


@torch.no_grad()
def test_unnormalised_top_k_and_fused_expert_tensors(pair, tmp_path):
    """norm_topk_prob = False (raw softmax weights), saved in transformers' fused in-memory expert layout
    (``experts.gate_up_proj [E, 2I, h]``): still transformers' logits."""
    from safetensors.torch import save_file

    hf = tiny_next(tmp_path / "hf", seed=1, norm_topk_prob=False)
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(d / "model.safetensors"))
    ours = load_model(d)
    assert not ours.args.norm_topk_prob
    ids = torch.randint(0, TINY_NEXT["vocab_size"], (20,), generator=torch.Generator().manual_seed(5))
    assert (prompt_logits(ours, ids) - hf(ids[None]).logits[0]).abs().max().item() < 1e-4


def test_bad_configs_and_missing_weights_are_one_line_errors(pair, tmp_path):
    _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    for over, msg in (({"num_experts_per_tok": 7}, "num_experts_per_tok must be in"),
                      ({"mlp_only_layers": [4]}, "mlp_only_layers must list"),
                      ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
                      ({"num_experts": -1}, "num_experts must be a non-negative")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **over}))
        with pytest.raises(CheckpointError, match=msg) as e:
            read_args(tmp_path)
        assert "\n" not in str(e.value)
    # num_experts = 0: every MLP dense
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts": 0}))
    assert not any(read_args(tmp_path).is_moe_layer(i) for i in range(4))
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.linear_attn.in_proj_qkvz.weight"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="in_proj_qkvz"):
        load_model(tmp_path)


def test_expert_mlp_width():
    from specpilot.model.args import ModelArgs

    args = ModelArgs.from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 12,
                              "num_hidden_layers": 1, "num_attention_heads": 2})
    assert MLP(args).up_proj.out_features == 12 and MLP(args, 5).up_proj.out_features == 5

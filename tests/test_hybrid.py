"""Hybrid (qwen3_5: Gated DeltaNet + gated attention) targets on the CPU in float32: logits equal transformers' own
Qwen3_5ForCausalLM on a tiny random config, for a prompt and token by token; the GDN tree path equals the chain."""

import pytest
import torch

from specpilot.model.cache import PassKind
from specpilot.model.checkpoint import load_model
from specpilot.model.gdn import conv_index, parents_from_mask

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            max_position_embeddings=512, eos_token_id=None, tie_word_embeddings=False)


def tiny_hybrid(path, seed: int = 0, **over):
    """Write a tiny random qwen3_5 text checkpoint to ``path`` (every parameter perturbed, so zero-centred norms and
    gates are exercised); returns transformers' model (float32, eval)."""
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**{**TINY, **over})
    hf = Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "A_log" in name or "dt_bias" in name else 0.05))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    hf = tiny_hybrid(path)
    return hf, load_model(path, dtype="float32"), path


def test_parents_and_conv_index():
    # rows: 0 root, 1 child of 0, 2 child of 0, 3 child of 2
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat((torch.ones(4, 5, dtype=torch.bool), anc), dim=1)
    assert parents_from_mask(mask, 5, 4) == [-1, 0, 0, 2]
    assert parents_from_mask(None, 5, 3) == [-1, 0, 1]
    # K = 4: window entries 0..2, rows at 3..6
    assert conv_index([-1, 0, 0, 2], 4).tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 5, 6]]


def incremental_max_diff(hf, ours, ids) -> float:
    """Max |logit difference| of a 5-token prefill then token-by-token decoding of ``ids`` (12 ids), ours vs HF."""
    out = hf(ids[None, :5], use_cache=True)
    past, refs = out.past_key_values, [out.logits[0, -1]]
    for t in range(5, len(ids)):
        out = hf(ids[None, t : t + 1], cache=past, use_cache=True)
        past = out.past_key_values
        refs.append(out.logits[0, -1])
    cache = ours.new_cache(64)
    got = [ours.logits(ours.forward(ids[:5], torch.arange(5), cache, 0))[-1]]
    cache.commit(5)
    for t in range(5, len(ids)):
        got.append(ours.logits(ours.forward(ids[t : t + 1], torch.tensor([t]), cache, t))[0])
        cache.commit(t + 1)
    return (torch.stack(got) - torch.stack(refs)).abs().max().item()


@torch.no_grad()
def test_prompt_logits_equal_transformers(pair):
    hf, ours, _ = pair
    assert ours.args.is_hybrid and ours.args.partial_rotary_factor == 0.25
    ids = torch.randint(0, TINY["vocab_size"], (23,), generator=torch.Generator().manual_seed(1))
    ref = hf(ids[None]).logits[0]
    cache = ours.new_cache(64)
    got = ours.logits(ours.forward(ids, torch.arange(23), cache, 0))
    assert (got - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_incremental_logits_equal_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(2))
    assert incremental_max_diff(hf, ours, ids) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_tree_rows_equal_their_chains_and_commit_equals_prefill(pair, mode):
    """Each tree row's logits equal those of its root path run as a chain; committing a path leaves the state,
    conv window and K/V equal to a prefill of the committed tokens (R9)."""
    _, ours, _ = pair
    ours.verify = mode
    try:
        prompt = torch.randint(0, TINY["vocab_size"], (9,), generator=torch.Generator().manual_seed(3))
        toks = torch.tensor([prompt[-1].item(), 5, 7, 11, 13])
        parents = [-1, 0, 0, 2, 3]  # root, two children, a path 0-2-3-4
        depth = [0, 1, 1, 2, 3]
        anc = torch.zeros(5, 5, dtype=torch.bool)
        for j in range(5):
            i = j
            while i >= 0:
                anc[j, i] = True
                i = parents[i]
        start = 8
        mask = torch.cat((torch.ones(5, start, dtype=torch.bool), anc), dim=1)
        cache = ours.new_cache(64)
        ours.forward(prompt[:8], torch.arange(8), cache, 0)
        cache.commit(8)
        tree_logits = ours.logits(ours.forward(toks, start + torch.tensor(depth), cache, start, mask))
        for j in range(5):
            path = [i for i in range(5) if anc[j, i]]
            c2 = ours.new_cache(64)
            full = torch.cat((prompt[:8], toks[path]))
            chain = ours.logits(ours.forward(full, torch.arange(len(full)), c2, 0, kind=PassKind.INSPECT))
            assert (chain[-1] - tree_logits[j]).abs().max().item() < 1e-4
        rows = torch.tensor([0, 2, 3])
        cache.compact(start, rows)
        cache.commit(start + 3)
        ref = ours.new_cache(64)
        full = torch.cat((prompt[:8], toks[rows]))
        ours.forward(full, torch.arange(11), ref, 0)
        ref.commit(11)
        assert (cache.state - ref.state).abs().max().item() < 1e-5
        assert (cache.window - ref.window).abs().max().item() < 1e-5
        assert (cache.k[:, :11] - ref.k[:, :11]).abs().max().item() < 1e-5
    finally:
        ours.verify = "snapshot"


@torch.no_grad()
def test_replay_commit_is_bit_equal_to_snapshot_commit(pair):
    """Committing a tree path by replay gives the same bits as taking the pass's own state of that row."""
    _, ours, _ = pair
    prompt = torch.randint(0, TINY["vocab_size"], (7,), generator=torch.Generator().manual_seed(4))
    parents = [-1, 0, 0, 1, 2, 4]
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for j in range(6):
        i = j
        while i >= 0:
            anc[j, i], i = True, parents[i]
    depth = anc.sum(1) - 1
    toks = torch.tensor([int(prompt[-1]), 3, 4, 5, 6, 7])
    mask = torch.cat((torch.ones(6, 6, dtype=torch.bool), anc), dim=1)
    states = {}
    for mode in ("snapshot", "replay"):
        ours.verify = mode
        cache = ours.new_cache(32)
        ours.forward(prompt[:6], torch.arange(6), cache, 0)
        cache.commit(6)
        ours.forward(toks, 6 + depth, cache, 6, mask)
        cache.compact(6, torch.tensor([0, 2, 4]))
        cache.commit(8)  # a stop cut the accepted path 0-2-4 after two rows
        states[mode] = cache.state.clone(), cache.window.clone()
    ours.verify = "snapshot"
    assert torch.equal(states["snapshot"][0], states["replay"][0])
    assert torch.equal(states["snapshot"][1], states["replay"][1])


def test_chunked_form_equals_recurrent_steps():
    from specpilot.model.gdn import delta_chunked, delta_step

    g0 = torch.Generator().manual_seed(5)
    t, h, dk, dv = 150, 4, 8, 16  # two full chunks of 64 and a partial one
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g0), dim=-1) / dk**0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g0), dim=-1)
    v, beta = torch.randn(t, h, dv, generator=g0), torch.rand(t, h, generator=g0)
    g = -2 * torch.rand(t, h, generator=g0)
    s = s0 = 0.1 * torch.randn(h, dk, dv, generator=g0)
    outs = []
    for i in range(t):
        s, o = delta_step(s, q[i], k[i], v[i], g[i], beta[i])
        outs.append(o)
    s2, o2 = delta_chunked(s0, q, k, v, g, beta)
    assert (s2 - s).abs().max().item() < 1e-5
    assert (o2 - torch.stack(outs)).abs().max().item() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("mode", ["snapshot", "replay"])  # recurrent prefill / chunked prefill (>= 128 rows)
def test_long_prompt_logits_equal_transformers(pair, mode):
    hf, ours, _ = pair
    ids = torch.randint(0, TINY["vocab_size"], (150,), generator=torch.Generator().manual_seed(6))
    ref = hf(ids[None]).logits[0]
    ours.verify = mode
    try:
        got = ours.logits(ours.forward(ids, torch.arange(150), ours.new_cache(160), 0))
    finally:
        ours.verify = "snapshot"
    assert (got - ref).abs().max().item() < 1e-4


def test_pass_off_the_committed_length_and_an_unsupported_hybrid_are_clear_errors(pair, tmp_path):
    import json

    from specpilot.errors import CheckpointError
    from specpilot.model.checkpoint import read_args

    _, ours, _ = pair
    cache = ours.new_cache(16)
    with pytest.raises(ValueError, match="committed length 0"):
        ours.forward(torch.tensor([1, 2]), torch.tensor([3, 4]), cache, 3)
    cfg = {"model_type": "qwen3_5_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'qwen3_5_moe'"):
        read_args(tmp_path)

"""Make the tiny EAGLE-3 checkpoint in this directory and the reference logits of the public reference
implementation (SafeAILab/EAGLE's ``eagle/model/cnets.py``, class ``Model``) for it, run locally on the CPU in float32.

Usage: ``python3 make_reference.py EAGLE_MODEL_DIR`` where ``EAGLE_MODEL_DIR`` holds ``cnets.py``, ``configs.py``,
``utils_c.py``, ``choices.py`` and ``utils.py`` of SafeAILab/EAGLE's ``eagle/model/`` (commit cb7e084 was used, with transformers 5.x: see the one shim below). None
of that code is stored here; only the checkpoint (config.json, model.safetensors) and the values
(``reference.json``) are. ``tests/test_eagle3_loader.py`` checks that our loader reproduces them.

Inputs (seeded): target features ``[1, 7, 3 * 32]`` and the tokens of rows 0..6 at positions 0..6 (step A, one
causal pass); then two sibling draft rows at position 7 (the top-2 draft ids of A's last row, mapped to target ids;
each reads A's last pre-norm hidden; EAGLE's tree mask keeps them apart: step B); then one row at position 8, the
top-1 child of B's first row, reading its pre-norm hidden and seeing only B's first row among the draft rows (step C).
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
H, HEADS, KV, INTER, VOCAB, DVOCAB = 32, 4, 2, 64, 64, 48


def main(eagle_dir: str) -> None:
    sys.path.insert(0, eagle_dir)
    from cnets import Model  # the reference implementation (not stored here)
    from configs import EConfig

    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", vocab_size=VOCAB, hidden_size=H,
               intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV,
               hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
               pretraining_tp=1, draft_vocab_size=DVOCAB, tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    torch.manual_seed(0)
    conf = EConfig(**cfg)
    # transformers 5 fills rope_scaling with {"rope_type": "default", ...}, which the reference (written for
    # transformers 4) reads as a scaling without a "type": put back the None it expects (the only shim).
    conf.rope_scaling, conf.rope_theta = None, 500.0
    model = Model(conf, load_emb=False, top_k=2).float().eval()
    assert model.midlayer.self_attn.rotary_emb.base == 500.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
        ids = torch.randperm(VOCAB)[:DVOCAB].sort().values
        model.d2t.copy_(ids - torch.arange(DVOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(HERE / "model.safetensors"))
    (HERE / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    feats = torch.randn(1, 7, 3 * H)
    tokens = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        out_a, kv = model(feats, input_ids=tokens, use_cache=True)  # positions 0..6, causal
        logits_a = model.lm_head(model.norm(out_a))[0]
        top2 = logits_a[-1].topk(2).indices
        b_tokens = (top2 + model.d2t[top2])[None]
        model.tree_mask = torch.eye(2)[None, None]
        out_b, kv_b = model(out_a[:, -1:].repeat(1, 2, 1), input_ids=b_tokens, past_key_values=kv,
                            position_ids=torch.tensor([7, 7]), use_cache=True)
        logits_b = model.lm_head(model.norm(out_b))[0]
        top1 = logits_b[0].argmax()
        c_tokens = (top1 + model.d2t[top1]).view(1, 1)
        model.tree_mask = torch.tensor([[[[1.0, 0.0, 1.0]]]])
        out_c, _ = model(out_b[:, :1], input_ids=c_tokens, past_key_values=kv_b, position_ids=torch.tensor([8]),
                         use_cache=True)
        logits_c = model.lm_head(model.norm(out_c))[0]
    ref = {"implementation": "SafeAILab/EAGLE eagle/model/cnets.py Model (commit cb7e084), CPU float32",
           "features": feats[0].tolist(), "tokens": tokens[0].tolist(),
           "logits_a": logits_a.tolist(), "b_tokens": b_tokens[0].tolist(), "logits_b": logits_b.tolist(),
           "c_token": int(c_tokens), "logits_c": logits_c.tolist(),
           "prenorm_a_last": out_a[0, -1].tolist()}
    (HERE / "reference.json").write_text(json.dumps(ref) + "\n")
    print("wrote", HERE, {k: (len(v) if isinstance(v, list) else v) for k, v in ref.items()})


if __name__ == "__main__":
    main(sys.argv[1])

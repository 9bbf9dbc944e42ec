"""Does the pilot run end to end on a hybrid (Gated DeltaNet) target? A tiny random qwen3_5 target (4 layers: 3 GDN +
1 gated attention, hidden 64, the bundled tokenizer's 4096 ids, its tokenizer copied in), a tiny random dense draft
model as stock's drafter and a random block drafter reading layers 0, 1, 3 for the planner; runs
``specpilot pilot --quick`` and ``specpilot replay`` on them (CPU, float32) and writes OUT/result.json (exit codes,
the sealed system, the report's headline figures, provenance). Random weights: every drafter's τ is about 1, so the
figures only show that each stage ran, not a speed-up. ``--moe``: a tiny qwen3_next target instead (6 experts, top 2,
a shared expert, layer 2 dense). Usage: python3 probes/hybrid_tiny_pilot.py OUT [--moe]"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from specpilot.model.checkpoint import load_model
from specpilot.provenance import git_commit, versions
from specpilot.spec.block import BlockNet, save_block
from specpilot.spec.block_net import BlockConfig
from specpilot.zoo import bundled_target_dir

out = Path(sys.argv[1])
ck = out / "checkpoints"
torch.manual_seed(4)
moe = "--moe" in sys.argv[2:]
shape = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
             max_position_embeddings=512, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
if moe:
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**shape, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, mlp_only_layers=[2])).float().eval()
else:
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape)).float().eval()
with torch.no_grad():  # every parameter perturbed, as the tests' tiny hybrids (zero-centred norms, gates exercised)
    for name, p in hf.named_parameters():
        big = "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith("mlp.gate.weight")
        p.add_(torch.randn_like(p) * (0.3 if big else 0.05))
hf.save_pretrained(ck / "target")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(bundled_target_dir() / f, ck / "target" / f)
Qwen3ForCausalLM(Qwen3Config(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                             eos_token_id=0)).eval().save_pretrained(ck / "draft")
a = load_model(ck / "target").args
save_block(BlockNet(BlockConfig(block_size=6, markov_rank=0, layers=1, heads=a.n_heads, kv_heads=a.n_kv_heads,
                                head_dim=a.head_dim, intermediate_size=2 * a.hidden_size, target_layers=[0, 1, 3],
                                target_hidden=a.hidden_size, vocab_size=a.vocab_size,
                                target_num_layers=a.num_layers)).eval(), ck / "block")

res = {"target": "qwen3_next" if moe else "qwen3_5_text", "device": "cpu", "dtype": "float32", "commit": git_commit(), "versions": versions(), "runs": {}}
stdout = {}
cmds = {"pilot": ["pilot", "--quick", "--target", ck / "target", "--drafter-path", ck / "draft", "--block", ck / "block",
                  "--out", out / "pilot"],
        "replay": ["replay", "--target", ck / "target", "--drafter", ck / "block", "--per-benchmark", "1",
                   "--max-new-tokens", "16", "--out", out / "replay", "--json"]}
for name, args in cmds.items():
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "specpilot", *map(str, args)], capture_output=True, text=True)
    res["runs"][name] = {"command": "specpilot " + " ".join(map(str, args)), "exit_code": p.returncode,
                         "seconds": round(time.perf_counter() - t0, 1), "stderr_tail": p.stderr[-2000:]}
    (out / f"{name}.log").write_text(p.stdout + p.stderr)
    stdout[name] = p.stdout
rep = out / "pilot" / "report.json"
if rep.is_file():
    r = json.loads(rep.read_text())
    res["pilot"] = {k: r.get(k) for k in ("sealed_label", "stock_label", "speedup_vs_ar", "speedup_ci_low",
                                          "speedup_vs_stock", "tau", "c", "ar_step_ms", "step_ms", "quick")}
    res["pilot"]["tlv_priced"] = r["cost_inputs"].get("tlv") is not None
    res["pilot"]["token_forcing_mismatches"] = r["token_forcing"]["mismatches"]
    res["pilot"]["token_forcing_tokens"] = r["token_forcing"]["tokens"]
if res["runs"]["replay"]["exit_code"] == 0:
    rows = json.loads(stdout["replay"].strip().splitlines()[-1])
    res["replay"] = {"rows": len(rows), "tau_max": max(r["tau"] for r in rows), "tau_min": min(r["tau"] for r in rows)}
(out / "result.json").write_text(json.dumps(res, indent=2, default=str))
print(json.dumps({k: v for k, v in res.items() if k != "versions"}, indent=2, default=str))
